"""The objective: its numbers, its blocks, and its losses (ce, kd, ce+kd) against direct
full-softmax computations, in float32 on CPU; the target's soft labels against a plain HF
forward; a distilling spec end to end through the real target worker and replica."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import dflash.runtime.gate as gate_mod
from conftest import assert_f32_close
from dflash.errors import SpecError
from dflash.models.drafter import DFlashConfig
from dflash.models.features import FeatureExtractor
from dflash.models.masks import IGNORE_INDEX, PackedRow
from dflash.train.anchors import loss_weights, sample_anchors
from dflash.models.target import load_target
from dflash.models.target_output import SoftLabels, TargetOutput, soft_positions
from dflash.spec.load import parse_spec, section_spec
from dflash.train.head_loss import balanced_chunk, head_backend, head_cross_entropy
from dflash.train.objective import Objective
from dflash.train.warm import synthetic_output, synthetic_row, warm_replica
from dflash.train.workers import (
    initial_state,
    make_replicas,
    make_target_workers,
)

H, V, MASK = 32, 96, 95


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread."""


def row(seed=0) -> PackedRow:
    """Three documents (prompt then response) and padding, in one row of 64."""
    g = torch.Generator().manual_seed(seed)
    doc = [0] * 24 + [1] * 20 + [2] * 14 + [-1] * 6
    pos = list(range(24)) + list(range(20)) + list(range(14)) + [0] * 6
    lm = [0] * 6 + [1] * 18 + [0] * 4 + [1] * 16 + [0] * 3 + [1] * 11 + [0] * 6
    return PackedRow(torch.randint(0, MASK, (64,), generator=g), torch.tensor(doc),
                     torch.tensor(pos), torch.tensor(lm).bool(), [0, 1, 2])


def objective(B, gamma=7.0, kind="ce", cap=None, top_k=8, anchors=12):
    return Objective(B, MASK, max_anchors=anchors, token_budget=64, gamma=gamma, kind=kind,
                     max_position=cap, top_k=top_k)


def case(B, seed=0, kind="ce", gamma=7.0, cap=None, top_k=8):
    torch.manual_seed(seed)
    obj = objective(B, gamma, kind, cap, top_k)
    r = row(seed)
    blocks = obj.anchors(r, seed)
    hidden = torch.randn(1, blocks.labels.numel(), H, requires_grad=True)
    head = torch.randn(V, H) / H ** 0.5
    target_logits = torch.randn(64, V) * 2      # a stand-in target's logits at every position
    return obj, r, blocks, hidden, head, target_logits


def soft_of(target_logits, r, k):
    pos = soft_positions(r.doc_ids, r.loss_mask)
    top = torch.log_softmax(target_logits[pos], -1).topk(k, dim=-1)
    return SoftLabels(pos, top.indices.to(torch.int32), top.values)


def reference(obj, blocks, hidden, head, target_logits, top_k):
    """The losses computed directly: full [n, V] logits and softmax, no chunking, no fusion,
    today's weights exp(-(k-1)/γ) (k >= 1, k <= cap)."""
    B = obj.block_size
    y = blocks.labels
    k = torch.arange(B).repeat(y.numel() // B)
    w = loss_weights(B, obj.gamma)[k] * (y != IGNORE_INDEX)
    if obj.max_position is not None:
        w = w * (k <= obj.max_position)
    logq = torch.log_softmax(hidden[0] @ head.t(), -1)
    ce = F.cross_entropy(hidden[0] @ head.t(), y.clamp(min=0), reduction="none")
    # the target's distribution for the token at anchor+k is its output at anchor+k-1
    src = (blocks.anchor_pos.repeat_interleave(B) + k - 1).clamp(0, 63)  # unlabelled: any
    lp = torch.log_softmax(target_logits[src], -1)
    top = lp.topk(top_k, dim=-1)
    p = torch.zeros_like(lp).scatter_(1, top.indices, torch.softmax(top.values, -1))
    kl = (p * (torch.log(p.clamp(min=1e-30)) - logq)).sum(-1)
    per = {"ce": ce, "kd": kl, "ce+kd": 0.5 * (ce + kl)}[obj.kind]
    return (per * w).sum() / w.sum()


@pytest.mark.parametrize("B,gamma,cap", [(4, 7.0, None), (16, 7.0, None), (16, 4.0, 8),
                                         (8, 1.5, 1), (5, 100.0, 3)])
def test_ce_loss_and_gradient_equal_direct_full_softmax(B, gamma, cap):
    obj, r, blocks, hidden, head, _ = case(B, gamma=gamma, cap=cap)
    loss, hits = obj.loss(hidden, head, blocks, chunk=7)   # several chunks, a ragged last one
    (g,) = torch.autograd.grad(loss, hidden)
    ref = reference(obj, blocks, hidden, head, torch.zeros(64, V), 1)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    # chunked vs one full softmax: the same float32 sums in another order; the loss sums
    # every supervised position's log-sum-exp over V, each hidden gradient element sums V
    # products of width H (see conftest.f32_close)
    assert_f32_close(loss, ref, blocks.labels.numel() * V)
    assert_f32_close(g, g_ref, V * H)
    # the cap: positions above it get no gradient at all, and no hits are counted there
    k = torch.arange(B).repeat(blocks.labels.numel() // B)
    if cap is not None:
        assert (g[0, k > cap] == 0).all() and (hits[cap + 1:] == 0).all()
    # hits: supervised positions whose top-1 is the label, per block position
    sup = obj.supervised(blocks).reshape(-1)
    top1 = (hidden[0] @ head.t()).argmax(-1) == blocks.labels
    want = torch.tensor([float((top1 & sup & (k == j)).sum()) for j in range(B)])
    torch.testing.assert_close(hits, want)
    assert not hits.requires_grad


def test_uncapped_weights_are_todays_and_the_cap_drops_positions():
    obj = objective(16)
    r = row()
    bl = obj.anchors(r, 3)
    w = obj.weights(bl).reshape(-1, 16)
    assert torch.equal(w[obj.supervised(bl)], loss_weights(16, 7.0).expand(w.shape[0], 16)[
        obj.supervised(bl)])
    capped = objective(16, cap=4)
    wc = capped.weights(bl).reshape(-1, 16)
    assert (wc[:, 5:] == 0).all() and torch.equal(wc[:, :5], w[:, :5])
    assert int(capped.supervised(bl).sum()) == int((w[:, :5] > 0).sum())


@pytest.mark.parametrize("kind,top_k,B,cap", [("kd", V, 4, None), ("kd", 5, 16, None),
                                              ("ce+kd", 8, 8, 3), ("ce+kd", V, 16, None)])
def test_kd_loss_and_gradient_equal_direct_full_softmax(kind, top_k, B, cap):
    """KD against the target's top-k (renormalised): with k = vocab it is the full forward
    KL(p_target || q_drafter); ce+kd is the mean of the two; all with the γ weights."""
    obj, r, blocks, hidden, head, tl = case(B, seed=1, kind=kind, cap=cap, top_k=top_k)
    soft = soft_of(tl, r, top_k)
    loss, _ = obj.loss(hidden, head, blocks, soft, row_len=64, chunk=11)
    (g,) = torch.autograd.grad(loss, hidden)
    ref = reference(obj, blocks, hidden, head, tl, top_k)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    # chunked vs one full softmax: the same float32 sums in another order; the loss sums
    # every supervised position's log-sum-exp over V, each hidden gradient element sums V
    # products of width H (see conftest.f32_close)
    assert_f32_close(loss, ref, blocks.labels.numel() * V)
    assert_f32_close(g, g_ref, V * H)
    assert float(loss.detach()) > 0


def test_kd_is_zero_when_the_drafter_is_the_target():
    """KL of a distribution to itself: the drafter's logits equal the target's (k = vocab)."""
    obj, r, blocks, _, _, _ = case(8, kind="kd", top_k=V)
    head = torch.eye(V)                                 # logits = hidden
    src = blocks.anchor_pos.repeat_interleave(8) + torch.arange(8).repeat(
        blocks.labels.numel() // 8) - 1
    tl = torch.randn(64, V)
    hidden = tl[src.clamp(0, 63)][None].clone().requires_grad_(True)
    loss, _ = obj.loss(hidden, head, blocks, soft_of(tl, r, V), row_len=64)
    assert abs(float(loss)) < 1e-5
    (g,) = torch.autograd.grad(loss, hidden)
    assert float(g.abs().max()) < 1e-6


def test_no_supervised_position_gives_zero_loss_and_gradient():
    obj = objective(4)
    r = row()
    r.loss_mask[:] = False                              # nothing to supervise
    bl = obj.anchors(r, 0)
    hidden = torch.randn(1, bl.labels.numel(), H, requires_grad=True)
    loss, hits = obj.loss(hidden, torch.randn(V, H), bl)
    loss.backward()
    assert float(loss) == 0 and (hidden.grad == 0).all() and (hits == 0).all()


def test_kd_without_soft_labels_is_refused():
    obj, r, blocks, hidden, head, _ = case(4, kind="kd")
    with pytest.raises(ValueError, match="soft labels"):
        obj.loss(hidden, head, blocks)


def test_anchors_are_the_scheduler_s_and_slots_scale_with_the_bucket():
    obj = objective(4, anchors=12)
    r = row()
    assert obj.num_slots(64) == 12 and obj.num_slots(32) == 6 and obj.num_slots(1) == 1
    a, b = obj.anchors(r, 5), sample_anchors(r, 12, 4, torch.Generator().manual_seed(5), MASK)
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in
               ("anchor_pos", "valid", "block_input_ids", "labels", "block_position_ids"))
    assert not torch.equal(obj.anchors(r, 6).anchor_pos, a.anchor_pos)


# ---------------------------------------------------------------------------------------------
# the target side: soft labels from the same forward as the features
# ---------------------------------------------------------------------------------------------
TARGET = section_spec("target", {"model": "llama-micro", "init": "random", "dtype": "float32",
                                 "num_feature_layers": 2})


def test_target_soft_labels_equal_a_plain_hf_forward():
    """One packed forward yields features equal to the feature-only path and, at every response
    position, the top-k log-probs of each document run alone through HF's own forward."""
    tgt = load_target(TARGET, "cpu", need_tokenizer=False)
    fx = FeatureExtractor(tgt, soft_top_k=6)
    r = row(2)
    r.input_ids = torch.randint(5, 49152, (64,), generator=torch.Generator().manual_seed(2))
    out = fx.outputs(r, "cpu")
    assert isinstance(out, TargetOutput)
    torch.testing.assert_close(out.features, fx(r.input_ids, r.doc_ids, r.position_ids))
    soft = out.soft
    assert torch.equal(soft.positions, soft_positions(r.doc_ids, r.loss_mask))
    assert soft.token_ids.shape == (soft.positions.numel(), 6)
    with torch.no_grad():
        for d in range(3):
            sel = torch.nonzero(r.doc_ids == d).flatten()
            lp = torch.log_softmax(tgt.model(input_ids=r.input_ids[sel][None]).logits[0], -1)
            mine = torch.isin(soft.positions, sel)
            local = soft.positions[mine] - sel[0]
            top = lp[local].topk(6, dim=-1)
            torch.testing.assert_close(soft.logprobs[mine], top.values, atol=1e-5, rtol=1e-5)
            assert torch.equal(soft.token_ids[mine].long(), top.indices)
    assert soft.nbytes() == soft.positions.numel() * (8 + 6 * (4 + 4))
    with pytest.raises(ValueError, match="whole target"):
        FeatureExtractor(load_target(TARGET, "cpu", need_tokenizer=False, num_layers=3),
                         soft_top_k=4)


KD_SPEC = {
    "name": "kd", "seed": 0,
    "target": {"model": "llama-micro", "init": "random", "num_feature_layers": 2},
    "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 4},
    "batching": {"token_budget": 64, "max_batch_size": 4, "max_anchors": 8, "num_buckets": 1},
    "loss": {"gamma": 4, "kind": "kd", "kd_top_k": 4},
    "topology": {"targets": ["cpu"], "drafters": ["cpu"], "allow_shared_devices": True},
    "data": {"source": "chatterbot-corpus", "max_prompt_tokens": 16, "max_new_tokens": 32},
    "optim": {"lr": 1e-2, "epochs": 1, "warmup_ratio": 0.0},
    "compile": {"backend": "eager"},
    "env": {"lock": "envs/cpu-py311.lock"},
}


def test_distilling_spec_runs_whole_target_and_trains_the_replica():
    """kd end to end on the real workers: the target worker loads the whole target and hands
    soft labels with the features; the replica's step lowers its KD loss on a fixed row."""
    spec = parse_spec(KD_SPEC, "kd.yaml")
    cfg = DFlashConfig.of_spec(spec)
    [(dev, fn)] = make_target_workers(spec)
    [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), 40)
    assert rep.objective.kind == "kd" and rep.objective.top_k == 4
    r = row(3)
    r.input_ids = torch.randint(5, 49152, (64,), generator=torch.Generator().manual_seed(3))
    out = fn(r)
    assert out.soft is not None and out.soft.top_k == 4
    blocks = rep.anchors(r, 0)
    losses = []
    for _ in range(25):
        res = rep.forward_backward(r, out, blocks)
        rep.clip_and_step()
        losses.append(float(res.loss))
    assert losses[-1] < losses[0] - 0.3 and min(losses) == losses[-1], losses


def test_max_position_must_be_a_block_position():
    bad = {**KD_SPEC, "loss": {"gamma": 4, "max_position": 4}}
    with pytest.raises(SpecError, match="loss.max_position"):
        parse_spec(bad, "kd.yaml")
    assert parse_spec({**KD_SPEC, "loss": {"gamma": 4, "max_position": 3}},
                      "kd.yaml").loss.max_position == 3
    with pytest.raises(SpecError, match="loss.kind"):
        parse_spec({**KD_SPEC, "loss": {"gamma": 4, "kind": "kl"}}, "kd.yaml")


def test_replica_step_counts_only_supervised_positions():
    """With loss.max_position the replica's books (labelled, per-position counts) and its
    gradient cover k <= K only; a bare feature tensor stands for a features-only output."""
    spec = parse_spec({**KD_SPEC, "loss": {"gamma": 4, "max_position": 2}}, "kd.yaml")
    cfg = DFlashConfig.of_spec(spec)
    [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), 10)
    r = row(4)
    blocks = rep.anchors(r, 1)
    feats = torch.randn(1, 64, len(cfg.target_layer_ids) * cfg.hidden_size)
    res = rep.forward_backward(r, feats, blocks)
    has = (blocks.labels != IGNORE_INDEX).reshape(-1, 4)
    assert res.counts == [0, int(has[:, 1].sum()), int(has[:, 2].sum()), 0]
    assert res.labelled == sum(res.counts) and float(res.hits[3]) == 0
    assert torch.isfinite(res.loss) and rep.flat_grad().abs().sum() > 0


def test_head_chunk_reaches_the_replica_and_changes_neither_loss_nor_gradient():
    """compile.head_chunk (a speed knob: the logits of one chunk at a time) gives the replica's
    step the same loss, hits and gradient as the default chunk (float32), in 16-row chunks."""
    flat = {}
    for chunk in (2048, 16):
        spec = parse_spec({**KD_SPEC, "loss": {"gamma": 4}, "compile": {"head_chunk": chunk}},
                          "kd.yaml")
        cfg = DFlashConfig.of_spec(spec)
        [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), 10)
        assert rep.objective.head_chunk == chunk
        r = row(4)
        blocks = rep.anchors(r, 1)
        feats = torch.randn(1, 64, len(cfg.target_layer_ids) * cfg.hidden_size,
                            generator=torch.Generator().manual_seed(2))
        res = rep.forward_backward(r, feats, blocks)
        assert chunk == 2048 or res.labelled > chunk  # more than one chunk
        flat[chunk] = (res.loss.detach(), res.hits, rep.flat_grad().clone())
    (loss, hits, grad), (loss0, hits0, grad0) = flat[16], flat[2048]
    assert torch.equal(hits, hits0)
    assert_f32_close(loss, loss0, res.labelled * cfg.vocab_size)
    assert_f32_close(grad, grad0, cfg.vocab_size * cfg.hidden_size)
    with pytest.raises(SpecError, match="compile.head_chunk"):
        parse_spec({**KD_SPEC, "compile": {"head_chunk": 8}}, "kd.yaml")


# ---------------------------------------------------------------------------------------------
# the compiled head loss (compile.head_loss): the eager path's numbers, one graph for any n
# ---------------------------------------------------------------------------------------------
CHUNK = 16  # every compiled test uses it: one graph per (kind, dtype) serves them all


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("kind,top_k", [("ce", 8), ("kd", 5)])
def test_compiled_head_loss_equals_the_eager_path(kind, top_k):
    """Loss, hits and the input gradient of the inductor-compiled chunks equal the eager
    chunks' (float32), hard labels and top-k soft labels, with a ragged last chunk."""
    obj, r, blocks, hidden, head, tl = case(16, seed=2, kind=kind, top_k=top_k)
    soft = soft_of(tl, r, top_k) if kind == "kd" else None

    n = int(obj.supervised(blocks).sum())
    c = balanced_chunk(obj.max_supervised(blocks.labels.numel()), CHUNK)
    assert obj.max_supervised(blocks.labels.numel()) == 12 * 15 and c == 15
    assert n % c, "the case must end in a partial chunk"
    got = {}
    for backend in (None, "inductor"):
        o = dataclasses.replace(obj, head_backend=backend)
        before = _graphs()
        loss, hits = o.loss(hidden, head, blocks, soft, row_len=64, chunk=CHUNK)
        (g,) = torch.autograd.grad(loss, hidden)
        got[backend] = (loss, hits, g)
        if backend is None:
            assert _graphs() == before                    # eager: nothing compiled
    assert not got["inductor"][1].requires_grad and float(got[None][1].sum()) > 0
    (loss_e, hits_e, g_e), (loss_c, hits_c, g_c) = got[None], got["inductor"]
    torch.testing.assert_close(hits_c, hits_e, atol=0, rtol=0)     # counts: exact
    # inductor fuses the chunk's kernels: float32 sums in another order (see conftest.f32_close)
    assert_f32_close(loss_c, loss_e, blocks.labels.numel() * V)
    assert_f32_close(g_c, g_e, V * H)


def test_compiled_head_loss_does_not_recompile_for_another_count():
    """A second step with a different number of supervised positions (another count of
    chunks, another ragged end) runs the same graph: refused recompiles would raise."""
    torch.manual_seed(0)
    Hh, Vv, B = 8, 40, 4

    def step(n):
        h = torch.randn(n, Hh, requires_grad=True)
        y = torch.randint(0, Vv, (n,))

        total, hits = head_cross_entropy(h, torch.randn(Vv, Hh), y[:, None], torch.ones(n, 1),
                                         torch.rand(n) + 0.1, y, torch.randint(0, B, (n,)), B,
                                         CHUNK, "inductor")
        total.backward()
        return h.grad

    before = _graphs()
    step(21)
    assert _graphs() == before + 1                        # it compiled once, here
    with torch.compiler.set_stance("fail_on_recompile"):
        # another count of chunks and ragged end; a whole number of chunks (no padding)
        assert step(50).shape == (50, Hh) and step(3).shape == (3, Hh)
        assert step(2 * CHUNK).shape == (2 * CHUNK, Hh)
    assert _graphs() == before + 1


def test_balanced_chunk_tiles_a_full_bucket_with_the_fewest_equal_chunks():
    for most, chunk in ((23040, 2048), (4096, 2048), (4097, 2048), (48, 2048), (1, 8), (0, 8)):
        c = balanced_chunk(most, chunk)
        q = -(-max(most, 1) // c)
        assert c <= chunk and q == -(-max(most, 1) // chunk) and q * c - max(most, 1) < q
    assert balanced_chunk(23040, 2048) == 1920


def test_head_loss_mode_resolves_per_device():
    assert head_backend("auto", "inductor", "cuda:0") == "inductor"
    assert head_backend("auto", "inductor", "cpu") is None
    assert head_backend("auto", "aot_eager", "cuda:1") is None
    assert head_backend("on", "aot_eager", "cpu") == "aot_eager"
    assert head_backend(True, "inductor", "cpu") == "inductor"
    assert head_backend(False, "inductor", "cuda:0") is None
    assert head_backend("on", "eager", "cuda:0") is None
    spec = parse_spec({**KD_SPEC, "compile": {"backend": "aot_eager", "head_loss": "on"}},
                      "kd.yaml")
    cfg = DFlashConfig.of_spec(spec)
    [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), 10)
    assert rep.objective.head_backend == "aot_eager"
    assert parse_spec(KD_SPEC, "kd.yaml").compile.head_loss == "auto"
    with pytest.raises(SpecError, match="compile.head_loss"):
        parse_spec({**KD_SPEC, "compile": {"head_loss": "fast"}}, "kd.yaml")


def test_warm_up_compiles_the_head_and_training_never_recompiles(monkeypatch):
    """The replica's step with the compiled head, warmed through the gate as the warm-up stage
    does it: steps on other rows (other supervised counts) after mark_warm are no recompile."""

    gate = gate_mod.Gate()
    monkeypatch.setattr(gate_mod, "_GATE", gate)
    spec = parse_spec({**KD_SPEC, "compile": {"backend": "aot_eager", "head_loss": "on"}},
                      "kd.yaml")
    cfg = DFlashConfig.of_spec(spec)
    [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), 10)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    before = _graphs()
    warm_replica(rep, 64, width, torch.float32, optimizer_step=False)
    assert _graphs() > before
    gate.mark_warm()
    try:
        counts = set()
        for seed in (1, 2, 3):
            r = synthetic_row(64, cfg.vocab_size, seed=seed, docs=seed)
            out, blocks = synthetic_output(rep, r, width, torch.float32, seed), rep.anchors(r, seed)
            res = gate.run(rep.signature(64), lambda: rep.forward_backward(r, out, blocks))
            counts.add(res.labelled)
            assert torch.isfinite(res.loss)
        st = gate.stats()
        assert len(counts) > 1 and st.recompiles_after_warmup == 0, st.recompile_reasons
    finally:
        gate.mark_cold()
