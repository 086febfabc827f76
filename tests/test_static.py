"""dflash/decode/static.py, the pieces both front doors share, on CPU: the target's static KV
cache at its full size with the model's own RoPE rows, and the step cycle (prepared once, then
``n`` eager steps where there is no graph)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.decode.engine import Engine
from dflash.decode.static import CapturedStep, TargetCache


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_target_cache_is_full_size_per_layer_with_the_models_rope():
    m = _model()
    c = TargetCache(m, rows=3, S=48)
    assert len(c.k) == len(c.v) == 2 and all(t.shape == (3, 2, 48, 8) for t in c.k + c.v)
    assert len({t.data_ptr() for t in c.k + c.v}) == 4        # one tensor each, never views
    cos, sin = m.model.rotary_emb(torch.zeros(1, 1), torch.arange(48)[None])
    assert torch.equal(c.cos, cos[0]) and torch.equal(c.sin, sin[0]) and c.pos_ar[-1] == 47


def test_captured_step_prepares_once_then_runs_n_eager_steps():
    calls = {"step": 0, "warm": 0}
    x = torch.zeros(())

    def step():
        calls["step"] += 1
        x.add_(1)

    def warm_up():
        calls["warm"] += 1
        assert torch.is_inference_mode_enabled()               # the warm-up runs as serving does

    stats = {}
    cs = CapturedStep(step, device=torch.device("cpu"), enabled=True, cuda_graph=False,
                      stats=stats, tag="test")
    assert cs.prepare(warm_up, "test: warm up") and cs.prepare(warm_up, "again")
    assert calls == {"step": 0, "warm": 1} and stats["compile_seconds"] >= 0
    cs.replay(3)
    assert calls["step"] == 3 and float(x) == 3 and cs.graph is None


def test_the_engine_on_its_target_cache():
    eng = Engine(_model(), slots=2, max_len=24, max_new_tokens=4, eos_ids=[63])
    assert eng.k_cache[0].shape[0] == 2 and eng.k_rows[0].shape[0] == 3  # + the spare row
    eng.prepare()                                               # CPU: nothing to capture
    assert eng.settings()["cuda_graph"] is False
    assert len(eng.generate([[1, 2, 3], [4, 5]])[0]) == 4       # no eos in reach: full answers
