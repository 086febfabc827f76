"""The CUDA-graph drafter step's math on CPU, float32 (issue #24 item 1): the fixed-shape loss
(every slot's positions 1..K, zero weight where unlabelled) equals today's host-selected loss,
loss, hits and every parameter's gradient, with a cap and with rows of few supervised tokens;
the step's body on static buffers equals today's step, buffers reloaded with another row; the
optimizer with a device-side lr gives today's parameters after several steps."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import dflash.train.checkpoint as ckpt
from conftest import assert_f32_close, f32_close
from dflash.errors import SpecError
from dflash.models.drafter import DFlashConfig
from dflash.models.masks import IGNORE_INDEX, PackedRow
from dflash.models.target_output import SoftLabels, TargetOutput, soft_positions
from dflash.spec.load import parse_spec
from dflash.train.graph_step import GraphStep, graph_step_on, restore, snapshot
from dflash.train.objective import Objective
from dflash.train.replica import lr_lambda, make_optimizer
from dflash.train.warm import warm_replica
from dflash.train.workers import initial_state, make_replicas

H, V, MASK, L = 32, 96, 95, 64

SPEC = {
    "name": "graph", "seed": 0,
    "target": {"model": "llama-micro", "init": "random", "num_feature_layers": 2},
    "drafter": {"num_layers": 1, "block_size": 4, "mask_token_id": 4},
    "batching": {"token_budget": 64, "max_batch_size": 4, "max_anchors": 8, "num_buckets": 1},
    "loss": {"gamma": 4},
    "topology": {"targets": ["cpu"], "drafters": ["cpu"], "allow_shared_devices": True},
    "data": {"source": "chatterbot-corpus", "max_prompt_tokens": 16, "max_new_tokens": 32},
    "optim": {"lr": 1e-2, "epochs": 1, "warmup_ratio": 0.3},
    "compile": {"backend": "eager"},
    "env": {"lock": "envs/cpu-py311.lock"},
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread."""


def packed_row(seed: int, response: int) -> PackedRow:
    """Two documents and padding in a row of 64; the last ``response`` tokens of each
    document are its answer (few supervised positions when small)."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.tensor([0] * 30 + [1] * 28 + [-1] * 6)
    pos = torch.tensor(list(range(30)) + list(range(28)) + [0] * 6)
    lm = torch.zeros(L, dtype=torch.bool)
    lm[30 - response:30] = True
    lm[58 - response:58] = True
    return PackedRow(torch.randint(5, MASK, (L,), generator=g), doc, pos, lm, [0, 1])


def _loss_case(B, cap, response, seed=0):
    torch.manual_seed(seed)
    obj = Objective(B, MASK, max_anchors=10, token_budget=L, gamma=4.0, max_position=cap)
    blocks = obj.anchors(packed_row(seed, response), seed)
    hidden = torch.randn(1, blocks.labels.numel(), H, requires_grad=True)
    head = torch.randn(V, H) / H ** 0.5
    return obj, blocks, hidden, head


@pytest.mark.parametrize("B,cap,response,backend", [
    (4, None, 20, None), (16, None, 20, None), (16, 8, 20, None), (8, 1, 20, None),
    (8, None, 2, None), (16, 3, 3, None), (16, 5, 20, "aot_eager"), (8, None, 2, "aot_eager"),
    (4, 9, 20, None)])  # a cap above the block: no cap
def test_static_loss_equals_the_host_selected_loss(B, cap, response, backend):
    obj, blocks, hidden, head = _loss_case(B, cap, response)
    obj = dataclasses.replace(obj, head_backend=backend)
    n = int(obj.supervised(blocks).sum())
    assert 0 < n <= blocks.labels.numel() // B * (B - 1 if cap is None else cap)
    loss, hits = obj.loss(hidden, head, blocks, chunk=7, host=blocks)
    (g,) = torch.autograd.grad(loss, hidden)
    s_loss, s_hits = obj.static_loss(hidden, head, blocks, chunk=7)
    (s_g,) = torch.autograd.grad(s_loss, hidden)
    # every slot, zero-weighted, vs the host-selected positions: float32 sums in another
    # order (the loss over positions × V, each hidden gradient element V products of width H)
    assert_f32_close(s_loss, loss, blocks.labels.numel() * V)
    torch.testing.assert_close(s_hits, hits, atol=0, rtol=0)
    assert_f32_close(s_g, g, V * H)
    k = torch.arange(B).repeat(blocks.labels.numel() // B)
    assert (s_g[0, (blocks.labels == IGNORE_INDEX)] == 0).all()
    if cap is not None:
        assert (s_g[0, k > cap] == 0).all()


def test_static_loss_of_a_row_without_labels_is_zero_with_zero_gradient():
    obj, blocks, hidden, head = _loss_case(4, None, 20)
    blocks = dataclasses.replace(blocks, labels=torch.full_like(blocks.labels, IGNORE_INDEX))
    loss, hits = obj.static_loss(hidden, head, blocks)
    (g,) = torch.autograd.grad(loss, hidden)
    assert float(loss.detach()) == 0.0 and (g == 0).all() and (hits == 0).all()


def _soft(r: PackedRow, top_k: int, seed: int = 0) -> SoftLabels:
    """A stand-in target's top-k log-probs at the row's label positions (one before each)."""
    pos = soft_positions(r.doc_ids, r.loss_mask)
    logits = torch.randn(L, V, generator=torch.Generator().manual_seed(seed)) * 2
    top = torch.log_softmax(logits[pos], -1).topk(top_k, dim=-1)
    return SoftLabels(pos, top.indices.to(torch.int32), top.values)


@pytest.mark.parametrize("kind,B,cap,response,backend", [
    ("kd", 16, 8, 20, None), ("kd", 4, None, 3, None), ("ce+kd", 8, 3, 20, None),
    ("ce+kd", 16, None, 2, None), ("kd", 16, 5, 20, "aot_eager")])
def test_static_soft_loss_equals_the_host_selected_loss(kind, B, cap, response, backend):
    """kd / ce+kd: the soft labels gathered from dense [L, k] buffers by every slot's row
    position give the loss, hits and gradient of the host-selected lookup (SoftLabels.at)."""
    obj, blocks, hidden, head = _loss_case(B, cap, response)
    obj = dataclasses.replace(obj, kind=kind, top_k=5, head_backend=backend)
    r = packed_row(0, response)
    soft = _soft(r, 5)
    loss, hits = obj.loss(hidden, head, blocks, soft, row_len=L, chunk=7, host=blocks)
    (g,) = torch.autograd.grad(loss, hidden)
    dense = obj.dense_soft(soft, L)
    assert dense[0].shape == (L, 5) and int((dense[1] != 0).any(-1).sum()) == len(soft.positions)
    s_loss, s_hits = obj.static_loss(hidden, head, blocks, chunk=7, soft=dense)
    (s_g,) = torch.autograd.grad(s_loss, hidden)
    assert_f32_close(s_loss, loss, blocks.labels.numel() * V)
    torch.testing.assert_close(s_hits, hits, atol=0, rtol=0)
    assert_f32_close(s_g, g, V * H)
    # the soft labels count: another target's give another loss
    other, _ = obj.static_loss(hidden, head, blocks, chunk=7, soft=obj.dense_soft(_soft(r, 5, 1), L))
    assert not f32_close(other, loss, blocks.labels.numel() * V)
    with pytest.raises(ValueError, match="loss.kind 'kd'.*dense soft labels"):
        dataclasses.replace(obj, kind="kd").static_loss(hidden, head, blocks)


def _replica(spec_over=None, capturable=False, total=10):
    spec = parse_spec({**SPEC, **(spec_over or {})}, "graph.yaml")
    cfg = DFlashConfig.of_spec(spec)
    [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), total)
    if capturable:
        rep.opt, rep.sched = make_optimizer(rep.params, spec.optim, rep.device, total,
                                            capturable=True)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    return rep, width


def _grads(rep):
    return [p.grad.clone() for p in rep.params]


@pytest.mark.parametrize("cap,response,kind", [(None, 20, "ce"), (2, 3, "ce"), (None, 2, "ce"),
                                               (3, 20, "kd"), (None, 3, "ce+kd")])
def test_step_on_static_buffers_equals_today_s_step(cap, response, kind):
    """Loss, hits and every parameter's gradient of the body on static buffers equal
    forward_backward's, first for the row the buffers were made with, then for another row
    loaded into them (the buffers, not the first row, are what the body reads; kd / ce+kd:
    the row's soft labels too)."""
    rep, width = _replica({"loss": {"gamma": 4, "max_position": cap, "kind": kind,
                                    "kd_top_k": 4}})
    rows = [packed_row(1, response), packed_row(2, 20)]
    feats = [TargetOutput(torch.randn(1, L, width, generator=torch.Generator().manual_seed(i)),
                          _soft(r, 4, i) if kind != "ce" else None)
             for i, r in enumerate(rows)]
    blocks = [rep.anchors(r, i) for i, r in enumerate(rows)]
    gs = GraphStep(rep, rows[0], feats[0], blocks[0])
    for i in range(2):
        if i:
            gs.load(rows[i], feats[i], blocks[i])
        res = rep.forward_backward(rows[i], feats[i], blocks[i])
        want = _grads(rep)
        rep.zero_grad()
        loss, hits, norm = gs.body(optimizer=False)
        assert norm is None and res.labelled > 0
        torch.testing.assert_close(loss, res.loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(hits, res.hits, atol=0, rtol=0)
        # not the same kernels (the body reduces over every slot, zero-weighted where
        # unlabelled): float32 sums in another order, each gradient element a sum over the
        # row's tokens of products over the hidden width, so depth L * H (observed here: up to
        # 6e-6 relative, 52 eps; a dropped position or another row is 1e-2 and more)
        for p, g, w in zip(rep.params, _grads(rep), want):
            assert_f32_close(g, w, L * H)
        assert not f32_close(want[0] * (1 + 1e-3), want[0], L * H)  # the bound can fail
        assert sum(float(g.abs().sum()) for g in want) > 0
        rep.zero_grad()


def test_device_lr_optimizer_gives_today_s_parameters_after_steps():
    """Five steps (warmup then cosine) of today's step against the static body with the
    capturable optimizer's tensor lr, filled by the scheduler: the same lr every step and the
    same parameters after; restore() puts a snapshot back in place."""
    a, width = _replica(total=6)
    b, _ = _replica(capturable=True, total=6)
    assert torch.is_tensor(b.opt.param_groups[0]["lr"])
    rows = [packed_row(s, 20) for s in range(5)]
    feats = [torch.randn(1, L, width, generator=torch.Generator().manual_seed(s))
             for s in range(5)]
    gs = GraphStep(b, rows[0], TargetOutput(feats[0]), a.anchors(rows[0], 0))
    snap = None
    for s in range(5):
        blocks = a.anchors(rows[s], s)
        res = a.forward_backward(rows[s], feats[s], blocks)
        norm_a = a.clip_and_step()
        gs.load(rows[s], feats[s], blocks)
        loss, _, norm_b = gs.body(optimizer=True)
        b.sched.step()
        torch.testing.assert_close(loss, res.loss, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(norm_b, norm_a, atol=1e-6, rtol=1e-5)
        assert float(b.opt.param_groups[0]["lr"]) == pytest.approx(a.lr(), rel=1e-6)
        if s == 1:
            snap = snapshot(b)
    for pa, pb in zip(a.params, b.params):
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5)
    assert all(float(p.grad.abs().sum()) == 0 for p in b.params)   # the body zeroes them
    moved = [p.detach().clone() for p in b.params]
    ids = [id(p) for p in b.params]
    restore(b, snap)
    assert [id(p) for p in b.params] == ids
    assert any(not torch.equal(m, p) for m, p in zip(moved, b.params))
    for p, v in zip(b.params, snap["params"]):
        assert torch.equal(p, v)


# ---------------------------------------------------------------------------------------------
# the production path's CPU-visible parts: the spec field, the capturable optimizer in a
# checkpoint, a failed capture that falls back, in-place gradients
# ---------------------------------------------------------------------------------------------
def test_spec_field_defaults_auto_resolves_per_device_and_refuses_what_cannot_apply():
    assert parse_spec(SPEC, "graph.yaml").compile.cuda_graph_step == "auto"
    assert graph_step_on("auto", "cuda:0", 1, 1) and graph_step_on(True, "cuda:1", 1, 1)
    assert not graph_step_on("auto", "cpu", 1, 1)
    assert not graph_step_on("auto", "cuda:0", 2, 1)
    assert not graph_step_on("auto", "cuda:0", 1, 2)
    assert not graph_step_on("off", "cuda:0", 1, 1)
    kd = {**SPEC, "loss": {"gamma": 4, "kind": "kd"}}   # soft labels are captured too
    assert parse_spec({**kd, "compile": {"cuda_graph_step": "on"}}, "graph.yaml")
    two = {**SPEC, "topology": {**SPEC["topology"], "drafters": ["cpu", "cpu"]}}
    with pytest.raises(SpecError, match="compile.cuda_graph_step"):
        parse_spec({**two, "compile": {"cuda_graph_step": "on"}}, "graph.yaml")
    with pytest.raises(SpecError, match="compile.cuda_graph_step"):
        parse_spec({**SPEC, "compile": {"cuda_graph_step": "always"}}, "graph.yaml")
    [rep] = make_replicas(parse_spec({**SPEC, "compile": {"cuda_graph_step": "on",
                                                           "backend": "eager"}}, "graph.yaml"),
                          DFlashConfig.of_spec(parse_spec(SPEC, "graph.yaml")),
                          initial_state(DFlashConfig.of_spec(parse_spec(SPEC, "graph.yaml")), 0), 4)
    assert not rep.graph_step   # a CPU drafter: never captured


def test_checkpoint_of_a_capturable_optimizer_resumes_its_lr_in_place(tmp_path):
    """The device-side lr is saved as a number (state.json is JSON) and loaded back into the
    very tensor a captured step reads; the state equals the saved one; lr() is the schedule's."""
    a, width = _replica(capturable=True, total=6)
    gs = GraphStep(a, packed_row(0, 20), TargetOutput(torch.randn(1, L, width)),
                   a.anchors(packed_row(0, 20), 0))
    for _ in range(3):
        gs.body(optimizer=True)
        a.sched.step()
    path = ckpt.save(tmp_path, 3, a, {}, keep=1, run_fingerprint={})
    b, _ = _replica(capturable=True, total=6)
    lr_tensor = b.opt.param_groups[0]["lr"]
    ckpt.load_into(path, ckpt.latest_good(tmp_path)[1], [b])
    assert b.opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(float(a.opt.param_groups[0]["lr"]), rel=1e-6)
    assert b.lr() == pytest.approx(a.lr(), rel=1e-6) and isinstance(b.lr(), float)
    assert b.lr() == pytest.approx(1e-2 * lr_lambda(6, 0.3)(3), rel=1e-7)  # today's rule
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)
        for k, v in a.opt.state[pa].items():
            assert torch.equal(torch.as_tensor(b.opt.state[pb][k]), torch.as_tensor(v))


def test_a_failed_capture_is_recorded_and_the_bucket_trains_uncaptured(capsys):
    """No CUDA here: the warm-up's capture fails loudly, the record says so, the weights and
    the optimizer are as before it (warm start), and the step is today's."""
    rep, width = _replica(capturable=True)
    ref, _ = _replica(capturable=True)
    rep.graph_step = True
    rec = warm_replica(rep, L, width, torch.float32, optimizer_step=False)
    assert rec["cuda_graph"]["captured"] is False and rec["cuda_graph"]["graph_error"]
    assert "CUDA-graph capture failed" in capsys.readouterr().err
    assert rep.graphs == {L: None}
    for p, q in zip(rep.params, ref.params):
        assert torch.equal(p, q) and float(p.grad.abs().sum()) == 0
    r = packed_row(3, 20)
    f = torch.randn(1, L, width)
    for x in (rep, ref):
        x.forward_backward(r, f, x.anchors(r, 3))
    for p, q in zip(rep.params, ref.params):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0)


def test_set_flat_grad_keeps_the_gradient_tensors():
    rep, width = _replica()
    r = packed_row(0, 20)
    rep.forward_backward(r, torch.randn(1, L, width), rep.anchors(r, 0))
    ids = [id(p.grad) for p in rep.params]
    flat = rep.flat_grad() * 0.5
    rep.set_flat_grad(flat)
    assert [id(p.grad) for p in rep.params] == ids
    assert torch.equal(rep.flat_grad(), flat)


def test_the_field_off_leaves_the_warmup_fingerprint_as_before():
    """Off is the step of before: its warm-ups stay valid; auto (the default) reruns them."""
    off = parse_spec({**SPEC, "compile": {"backend": "eager", "cuda_graph_step": "off"}},
                     "graph.yaml")
    on = parse_spec(SPEC, "graph.yaml")
    assert "cuda_graph_step" not in off.section("warmup")["compile"]
    assert off.section("warmup")["compile"] == {"backend": "eager", "head_loss": "auto"}
    assert on.fingerprint("warmup") != off.fingerprint("warmup")
