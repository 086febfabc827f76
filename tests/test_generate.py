"""The fast generation engine (dflash/decode/engine.py) on the real SmolLM2-135M-Instruct, float32, CPU."""
from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM

from dflash.decode.sampling import mix32, gumbel_noise, seed_keys
from dflash.decode.engine import Engine, generate
from dflash.decode.generate import eos_ids_of, open_generator, resolve_engine
from dflash.data.generate import generate_chunks
from dflash.data.prompts import load_prompts, render_prompt
from dflash.errors import DFlashError
from dflash.models.target import load_target
from dflash.spec.load import section_spec

TARGET = section_spec("target", {"model": "smollm2-135m-instruct", "init": "pretrained",
                                 "dtype": "float32", "num_feature_layers": 5})


@pytest.fixture(scope="module")
def smol():
    return load_target(TARGET, "cpu")


@pytest.fixture(scope="module")
def prompts(smol):
    """Chatterbot prompts 0, 1, 2, 6, 3 (seed 0): with 20 new tokens, #1 ends at eos after 16
    tokens and #6 after 10, the others run to the limit; plus a bare 3-token prompt."""
    ps, _ = load_prompts("chatterbot-corpus", 7, 0, 0.05)
    out = [render_prompt(smol.tokenizer, ps[i].messages) for i in (0, 1, 2, 6, 3)]
    return out + [[1, 504, 3458]]


def hf_greedy(model, p, n, eos):
    out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos[0])[0, len(p):].tolist()
    return out[:next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


@pytest.fixture(scope="module")
def refs(smol, prompts):
    return [hf_greedy(smol.model, p, 20, eos_ids_of(smol)) for p in prompts]


def test_greedy_equals_hf_generate_prompt_by_prompt(smol, prompts, refs):
    eos = eos_ids_of(smol)
    assert len({len(p) for p in prompts}) == len(prompts)  # all lengths differ
    eng = Engine(smol.model, slots=2, max_len=max(map(len, prompts)) + 20, max_new_tokens=20,
                 eos_ids=eos)
    ours = eng.generate(prompts)
    assert ours == refs
    lengths = [len(o) for o in ours]
    ended = sorted(n for o, n in zip(ours, lengths) if o[-1] in eos)
    assert ended[:2] == [10, 16] and lengths.count(20) >= 3  # eos at different steps + limit
    assert eng.stats["prefill_calls"] >= 3  # more prompts than slots: slots were refilled
    assert eng.stats["answers"] == len(prompts) and eng.stats["new_tokens"] == sum(lengths)
    # the engine is reusable, and one slot per prompt gives the same answers
    assert eng.generate(prompts[:3]) == refs[:3]
    assert generate(smol.model, prompts, 20, eos_ids=eos, slots=8) == refs


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_gpu_schedule_gives_the_same_answers(smol, prompts, refs, attention):
    """The CUDA defaults' schedule on CPU: host sync every 4 steps (finished slots idle until
    then), refill only when 2 slots are free, prefill in fixed shapes (3 rows × a multiple of
    32 tokens; unused rows go to the spare cache row), either decode attention."""
    eos = eos_ids_of(smol)
    eng = Engine(smol.model, slots=3, max_len=max(map(len, prompts)) + 20, max_new_tokens=20,
                 eos_ids=eos, sync_every=4, refill_at=2, prefill_batch=3, padded_prefill=True,
                 attention=attention)
    assert eng.generate(prompts) == refs
    assert eng.stats["decode_steps"] % 4 == 0 and eng.stats["prefill_calls"] >= 2
    assert set(eng.prefill.bufs) <= set(eng.prefill.lengths())
    assert all(P % 32 == 0 for P in eng.prefill.bufs)


def test_sampling_is_seeded_and_independent_of_slots_and_order(smol, prompts):
    eos = eos_ids_of(smol)
    ps = prompts[:4]
    seeds = [11, 22, 33, 44]
    kw = dict(max_len=max(map(len, ps)) + 8, max_new_tokens=8, eos_ids=eos, temperature=1.0)
    a = Engine(smol.model, slots=4, **kw).generate(ps, seeds)
    b = Engine(smol.model, slots=1, **kw).generate(ps[::-1], seeds[::-1])[::-1]
    c = Engine(smol.model, slots=3, **kw).generate(ps, seeds)
    assert a == b == c
    greedy = Engine(smol.model, slots=4, **dict(kw, temperature=0.0)).generate(ps)
    assert a != greedy  # T=1 really samples
    other = Engine(smol.model, slots=4, **kw).generate(ps, [s + 1 for s in seeds])
    assert sum(x != y for x, y in zip(a, other)) >= 3  # the seed matters


def test_gumbel_max_samples_the_softmax():
    """Counter-based noise: argmax(logits + G) hits each token at its softmax probability."""
    V, n = 6, 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    vh = mix32(torch.arange(V, dtype=torch.int64) * 0x9E3779B1 & 0xFFFFFFFF)
    keys = seed_keys(torch.arange(n, dtype=torch.int64) * 7919 + 5)
    steps = torch.full((n,), 3, dtype=torch.int64)
    picks = (logits[None] + gumbel_noise(keys, steps, vh)).argmax(-1)
    freq = torch.bincount(picks, minlength=V).double() / n
    probs = torch.softmax(logits.double(), -1)
    assert torch.allclose(freq, probs, atol=4 * math.sqrt(0.25 / n)), (freq, probs)
    # pure function of (key, step, index): same inputs same noise, next step different noise
    g = gumbel_noise(keys[:4], steps[:4], vh)
    assert torch.equal(g, gumbel_noise(keys[:4], steps[:4], vh))
    assert not torch.equal(g, gumbel_noise(keys[:4], steps[:4] + 1, vh))


def test_compiled_decode_step_compiles_once_for_all_layers(smol, prompts):
    """Regional compile (aot_eager here: no C++ build): one graph per piece serves all 30
    layers, and the compiled engine gives the eager engine's greedy answers."""
    eos = eos_ids_of(smol)
    ps = prompts[:3]
    kw = dict(slots=2, max_len=max(map(len, ps)) + 6, max_new_tokens=6, eos_ids=eos)
    torch._dynamo.reset()
    counters.clear()
    compiled = Engine(smol.model, compile="aot_eager", **kw)
    got = compiled.generate(ps)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    assert compiled.stats["compile_seconds"] > 0
    assert got == Engine(smol.model, **kw).generate(ps)


def test_engine_choice_and_errors(smol):
    assert resolve_engine("auto", smol.model) == "fast"
    assert resolve_engine("hf", smol.model) == "hf"
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64))
    assert resolve_engine("auto", gpt2) == "hf"
    with pytest.raises(DFlashError, match="data.engine 'fast'.*gpt2"):
        resolve_engine("fast", gpt2)
    with pytest.raises(DFlashError, match="data.engine: 'vllm'"):
        resolve_engine("vllm", smol.model)
    eng = Engine(smol.model, slots=1, max_len=16, max_new_tokens=8, eos_ids=[2])
    with pytest.raises(DFlashError, match="prompt 0 has 9 tokens; 1..8 fit"):
        eng.generate([[1] * 9])
    with pytest.raises(DFlashError, match="no eos"):
        Engine(smol.model, slots=1, max_len=16, max_new_tokens=8, eos_ids=[])


def test_front_door_serves_both_engines_and_the_chunk_pool(smol, prompts, refs):
    """open_generator gives one object for either engine (greedy: HF greedy answers);
    generate_chunks spreads chunks over two workers and hands each chunk back whole."""
    kw = dict(slots=2, max_len=max(map(len, prompts)) + 20, max_new_tokens=20, temperature=0.0)
    for name in ("fast", "hf"):
        gen = open_generator(name, smol, **kw)
        assert gen.engine == name
        # the hf engine left-pads a batch; its answers equal the unpadded reference here
        assert gen.generate(prompts[:2], [0, 0]) == refs[:2], name
    assert open_generator("auto", smol, **kw, items=1).settings()["slots"] == 1  # <= items
    chunks = [(c, prompts[2 * c:2 * c + 2], [0, 0]) for c in range(2)]
    got: dict[int, list] = {}
    gens = generate_chunks(["cpu", "cpu"], lambda dev: open_generator("fast", smol, **kw),
                           chunks, lambda dev, c, answers, t: got.__setitem__(c, answers))
    assert got == {c: refs[2 * c:2 * c + 2] for c in range(2)}
    assert len(gens) == 2 and all(g.settings()["cuda_graph"] is False for g in gens)
    with pytest.raises(RuntimeError, match="disk full"):  # a failing chunk stops the pool
        generate_chunks(["cpu"], lambda dev: open_generator("hf", smol, **kw), chunks,
                        lambda dev, c, a, t: (_ for _ in ()).throw(RuntimeError("disk full")))


class _ScalarIndexWrites(torch.utils._python_dispatch.TorchDispatchMode):
    """Records index_put_ calls whose values are a 0-dim tensor: a Python scalar written
    through a tensor index (``t[idx] = 1``). On CUDA that scalar is a CPU tensor copied to the
    device, which CUDA-graph capture refuses, so a captured body must not do it."""

    def __init__(self):
        super().__init__()
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.index_put_, torch.ops.aten.index_put,
                                   torch.ops.aten._index_put_impl_):
            values = args[2] if len(args) > 2 else (kwargs or {}).get("values")
            if isinstance(values, torch.Tensor) and values.dim() == 0:
                self.hits.append(str(func))
        return func(*args, **(kwargs or {}))


def test_captured_bodies_write_no_python_scalar_through_a_tensor_index(smol, prompts, refs):
    """The padded prefill and the decode step are CUDA-graph captured on the GPU: the round-3
    data stages ran every prefill uncaptured because ``rows["gen"][idx] = 1`` copied a CPU
    scalar during capture. The same bodies, on CPU, under a mode that sees each index write."""
    eng = Engine(smol.model, slots=3, max_len=max(map(len, prompts)) + 20, max_new_tokens=20,
                 eos_ids=eos_ids_of(smol), sync_every=4, refill_at=2, prefill_batch=3,
                 padded_prefill=True)
    mode = _ScalarIndexWrites()
    with mode:
        got = eng.generate(prompts)
    assert got == refs
    assert eng.stats["prefill_calls"] >= 2 and eng.stats["decode_steps"] > 0
    assert mode.hits == []
