"""drafter.init target-layers: the target's last decoder layers copied into the drafter, shape
errors naming the field, training from there, and the fingerprints it changes."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from dflash.errors import SpecError
from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.models.drafter_init import target_layers_state
from dflash.models.masks import PackedRow
from dflash.models.target import load_target
from dflash.spec.load import load_spec
from dflash.train.workers import initial_state, make_replicas

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Small shapes: one intra-op thread is faster and robust to a busy machine."""


def _target(cfg):
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(cfg)


def _drafter_state(tcfg, n, **override):
    cfg = DFlashConfig.from_target_config(tcfg, n, 4, 0, layer_ids=[0, 1])
    for k, v in override.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return {k: v.clone() for k, v in DFlashDrafter(cfg).state_dict().items()}


def test_qwen3_layers_copied_in_order_own_pieces_kept():
    tcfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_hidden_layers=5, intermediate_size=96, vocab_size=128)
    model = _target(tcfg)
    state = _drafter_state(tcfg, 2)
    new, kept = target_layers_state(state, model.model.layers)
    assert kept == []                                # Qwen3 has q/k norms: everything copied
    for j, src in ((0, 3), (1, 4)):                  # drafter layer j <- target layer 3 + j
        tsd = model.model.layers[src].state_dict()
        for rest, w in tsd.items():
            assert torch.equal(new[f"layers.{j}.{rest}"], w), (j, rest)
    for k in ("fc.weight", "hidden_norm.weight", "norm.weight"):   # no target counterpart
        assert torch.equal(new[k], state[k])
    assert not torch.equal(new["layers.0.mlp.up_proj.weight"], state["layers.0.mlp.up_proj.weight"])


def test_shape_mismatch_and_too_many_layers_name_the_field():
    tcfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=3, intermediate_size=96, vocab_size=128)
    model = _target(tcfg)
    wide = _drafter_state(tcfg, 1, intermediate_size=128)
    with pytest.raises(SpecError, match=r"spec.yaml: field 'drafter.init'.*mlp\.gate_proj.*"
                                        r"\(128, 64\).*\(96, 64\)"):
        target_layers_state(wide, model.model.layers, "spec.yaml")
    with pytest.raises(SpecError, match=r"'drafter.init'.*drafter.num_layers = 4.*has 3"):
        target_layers_state(_drafter_state(tcfg, 4), model.model.layers)
    # a Llama target has no q/k norms: those stay at their initial 1, and say so
    new, kept = target_layers_state(_drafter_state(tcfg, 1), model.model.layers)
    assert kept == ["layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"]
    assert bool((new["layers.0.self_attn.q_norm.weight"] == 1).all())


def test_smollm2_last_layers_copied_and_training_runs():
    """The tiny spec's real target (SmolLM2-135M, 30 layers): a 2-layer drafter starts as its
    layers 28 and 29, through the trainer's own initial_state; a replica built on those weights
    trains (its loss falls on a fixed batch) and moves them."""

    base = load_spec(REPO / "specs" / "tiny.yaml")
    spec = base.replace(drafter={"num_layers": 2, "init": "target-layers"},
                        compile={"backend": "eager"}, topology={"drafters": ["cpu"]})
    cfg = DFlashConfig.of_spec(spec)
    state = initial_state(cfg, spec.seed, spec)
    layers = load_target(spec.target, "cpu", need_tokenizer=False).model.model.layers
    assert len(layers) == 30
    for j in (0, 1):
        for rest, w in layers[28 + j].state_dict().items():
            assert torch.equal(state[f"layers.{j}.{rest}"], w.to(state[f"layers.{j}.{rest}"]))
    rand = initial_state(cfg, spec.seed)             # random: the same as without a spec
    assert torch.equal(state["fc.weight"], rand["fc.weight"])
    assert not torch.equal(state["layers.0.mlp.up_proj.weight"], rand["layers.0.mlp.up_proj.weight"])

    (rep,) = make_replicas(spec, cfg, state, total_steps=8)
    g = torch.Generator().manual_seed(0)
    L = 96
    row = PackedRow(torch.randint(5, 1000, (L,), generator=g), torch.zeros(L, dtype=torch.long),
                    torch.arange(L), torch.tensor([False] * 32 + [True] * 64), [0])
    feats = torch.randn(1, L, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    blocks = rep.anchors(row, 0)
    losses = []
    for _ in range(6):
        losses.append(float(rep.forward_backward(row, feats, blocks).loss))
        rep.clip_and_step()
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    assert not torch.equal(rep.model.state_dict()["layers.0.mlp.up_proj.weight"],
                           state["layers.0.mlp.up_proj.weight"])


def test_init_changes_the_train_fingerprint_only():
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    init = spec.replace(drafter={"init": "target-layers"})
    stages = ("env", "warmup", "data", "train", "bench")
    assert {s for s in stages if init.fingerprint(s) != spec.fingerprint(s)} == {"train"}
    # random, the default, leaves the train fingerprint as it was before the field existed
    assert "drafter.init" not in spec.section("train") and \
        init.section("train")["drafter.init"] == "target-layers"
    with pytest.raises(SpecError, match="drafter.init"):
        spec.replace(drafter={"init": "copy"})


def test_replicas_start_bit_identical_from_the_initial_state_and_never_alias_it():
    """make_replicas builds each drafter on the meta device and loads the initial state (no
    random init of its own): every replica's weights equal that state bit for bit, the state
    is today's seeded one (the same as a fresh seeded DFlashDrafter's), and training a replica
    changes neither the state nor the other replica."""
    base = load_spec(REPO / "specs" / "tiny.yaml")
    spec = base.replace(compile={"backend": "eager"}, topology={"drafters": ["cpu", "cpu"]})
    cfg = DFlashConfig.of_spec(spec)
    state = initial_state(cfg, spec.seed)
    torch.manual_seed(spec.seed)
    fresh = DFlashDrafter(cfg).state_dict()
    assert state.keys() == fresh.keys() and all(torch.equal(state[k], fresh[k]) for k in state)
    before = {k: v.clone() for k, v in state.items()}
    a, b = make_replicas(spec, cfg, state, total_steps=4)
    for rep in (a, b):
        got = rep.model.state_dict()
        assert got.keys() == state.keys()
        assert all(torch.equal(got[k], state[k]) for k in state)
    for p in a.model.parameters():
        with torch.no_grad():
            p.add_(1.0)
    assert all(torch.equal(state[k], before[k]) for k in state)
    assert all(torch.equal(b.model.state_dict()[k], before[k]) for k in state)
