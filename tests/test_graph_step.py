"""The CUDA-graph drafter step's math on CPU, float32 (issue #24 item 1): the fixed-shape loss
(every slot's positions 1..K, zero weight where unlabelled) equals today's host-selected loss,
loss, hits and every parameter's gradient, with a cap and with rows of few supervised tokens;
the step's body on static buffers equals today's step, buffers reloaded with another row; the
optimizer with a device-side lr gives today's parameters after several steps."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.models.masks import IGNORE_INDEX, PackedRow
from dflash.models.target_output import TargetOutput
from dflash.spec import parse_spec
from dflash.train.graph_step import GraphStep, restore, snapshot
from dflash.train.objective import Objective
from dflash.train.replica import make_optimizer
from dflash.train.workers import drafter_config, initial_state, make_replicas

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
    (8, None, 2, None), (16, 3, 3, None), (16, 5, 20, "aot_eager"), (8, None, 2, "aot_eager")])
def test_static_loss_equals_the_host_selected_loss(B, cap, response, backend):
    obj, blocks, hidden, head = _loss_case(B, cap, response)
    obj = dataclasses.replace(obj, head_backend=backend)
    n = int(obj.supervised(blocks).sum())
    assert 0 < n <= blocks.labels.numel() // B * (B - 1 if cap is None else cap)
    loss, hits = obj.loss(hidden, head, blocks, chunk=7, host=blocks)
    (g,) = torch.autograd.grad(loss, hidden)
    s_loss, s_hits = obj.static_loss(hidden, head, blocks, chunk=7)
    (s_g,) = torch.autograd.grad(s_loss, hidden)
    torch.testing.assert_close(s_loss, loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_hits, hits, atol=0, rtol=0)
    torch.testing.assert_close(s_g, g, atol=1e-7, rtol=1e-6)
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


def test_static_loss_refuses_soft_labels():
    obj, blocks, hidden, head = _loss_case(4, None, 20)
    with pytest.raises(ValueError, match="loss.kind 'kd'"):
        dataclasses.replace(obj, kind="kd").static_loss(hidden, head, blocks)


def _replica(spec_over=None, capturable=False, total=10):
    spec = parse_spec({**SPEC, **(spec_over or {})}, "graph.yaml")
    cfg = drafter_config(spec)
    [rep] = make_replicas(spec, cfg, initial_state(cfg, 0), total)
    if capturable:
        rep.opt, rep.sched = make_optimizer(rep.params, spec.optim, rep.device, total,
                                            capturable=True)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    return rep, width


def _grads(rep):
    return [p.grad.clone() for p in rep.params]


@pytest.mark.parametrize("cap,response", [(None, 20), (2, 3), (None, 2)])
def test_step_on_static_buffers_equals_today_s_step(cap, response):
    """Loss, hits and every parameter's gradient of the body on static buffers equal
    forward_backward's, first for the row the buffers were made with, then for another row
    loaded into them (the buffers, not the first row, are what the body reads)."""
    rep, width = _replica({"loss": {"gamma": 4, "max_position": cap}})
    rows = [packed_row(1, response), packed_row(2, 20)]
    feats = [torch.randn(1, L, width, generator=torch.Generator().manual_seed(i))
             for i in range(2)]
    blocks = [rep.anchors(r, i) for i, r in enumerate(rows)]
    gs = GraphStep(rep, rows[0], TargetOutput(feats[0]), blocks[0])
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
        for p, g, w in zip(rep.params, _grads(rep), want):
            torch.testing.assert_close(g, w, atol=1e-7, rtol=1e-5)
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
