"""A drafter replica's whole step (forward, backward, clip, AdamW, zero) as one CUDA graph per
shape bucket (issue #24 item 1).

Why: at SmolLM2's shape the compiled step without its head launches ~580 kernels for 18 ms of
GPU work in 27 ms (bench/results/h200/round3-2026-12-01/loss_step2.json): the H200 machines'
launches are slow, so a step is launch-bound until its kernels replay as one graph.

What makes the step capturable:

* static inputs: one set of device buffers per bucket (features, the row's document ids and
  positions, the blocks' tensors: views of one byte buffer, :mod:`dflash.train.host_pack`); a
  step copies its row into them (:meth:`GraphStep.load`: two copies) and replays. The
  FlexAttention BlockMask is built inside the graph from those buffers (its compiled
  construction has no host sync and reads the buffers' new values at each replay), so nothing
  of a row's mask is baked into the graph;
* a fixed-shape loss (:meth:`dflash.train.objective.Objective.static_loss`): every slot's
  block positions 1..K with zero weight where unlabelled, instead of the rows the host finds;
  a distilling objective's soft labels (kd, ce+kd) sit in two more static buffers, dense by
  row position (:meth:`~dflash.train.objective.Objective.dense_soft`), so every slot's soft
  labels are a gather (round 3's kd step ran uncaptured: 1.35x the captured step at round 5);
* the optimizer's step count and lr on the device (``make_optimizer(capturable=True)``): the
  scheduler fills the lr tensor after each replay, the graph reads it at the next.

Owns the static buffers and the step's body; the capture and replay calls are
:mod:`dflash.models.graphs`'s. The caller holds the compile gate (the body's first run may
compile) and keeps one replica per device: the graph zeroes the gradients it made, so
multi-replica gradient averaging keeps the uncaptured step.
"""
from __future__ import annotations

import contextlib

import torch

from ..models.graphs import capture
from ..models.masks import Blocks, PackedRow
from ..models.target_output import TargetOutput
from .host_pack import PackedLayout

_ROW = ("doc_ids", "position_ids")
_BLOCKS = ("anchor_pos", "valid", "block_input_ids", "block_position_ids", "labels",
           "block_doc")


class GraphStep:
    """One bucket's step on static buffers: :meth:`body` uncaptured (CPU, checks), or
    :meth:`capture` then :meth:`replay`. ``rep``: a :class:`DrafterReplica` whose optimizer
    was made capturable."""

    def __init__(self, rep, row: PackedRow, target: TargetOutput, blocks: Blocks):
        dev = torch.device(rep.device)
        self.rep, self.graph, self.out = rep, None, None
        self.features = target.features.to(dev).clone()
        small = small_tensors(row, blocks)
        self.layout = PackedLayout(small)  # the row's small tensors: views of ONE buffer
        self.flat = self.layout.pack(small, pin=False).to(dev)
        views = self.layout.views(self.flat)
        self.row = {n: views[n] for n in _ROW}
        self.blocks = Blocks(**{n: views[n] for n in _BLOCKS}, block_size=blocks.block_size)
        self.position_weights = rep.objective.position_weights(dev)  # no host copy in-graph
        self.soft = None  # kd / ce+kd: the row's soft labels, dense [L, top_k] ids and log-probs
        if rep.objective.soft_labels:
            self.soft = rep.objective.dense_soft(target.soft, row.input_ids.shape[0], device=dev)

    def load(self, row: PackedRow, target: TargetOutput | torch.Tensor, blocks: Blocks) -> None:
        """Copy one row into the static buffers: its features, and its small tensors in one
        copy from pinned memory (both non-blocking; shapes must be the bucket's)."""
        feats = target.features if isinstance(target, TargetOutput) else target
        dev = self.features.device
        with _on(dev):  # the copies queue on the stream the replay uses
            self.features.copy_(feats, non_blocking=True)
            self.flat.copy_(self.layout.pack(small_tensors(row, blocks), pin=dev.type == "cuda"),
                            non_blocking=True)
            if self.soft is not None:
                self.rep.objective.dense_soft(target.soft, row.input_ids.shape[0], out=self.soft)

    def forward_backward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, hits) of the static buffers' row, the gradients accumulated in ``.grad``."""
        rep, b = self.rep, self.blocks
        loss, hits = rep.forward_loss(
            self.row["doc_ids"], b, self.features, self.row["position_ids"][None],
            lambda hidden: rep.objective.static_loss(hidden, rep.lm_head, b,
                                                     position_weights=self.position_weights,
                                                     soft=self.soft))
        loss.backward()
        return loss.detach(), hits

    def body(self, optimizer: bool = True) -> tuple[torch.Tensor, ...]:
        """forward + backward, and with ``optimizer`` the clip, the AdamW step and the zeroing
        of the gradients: (loss, hits, pre-clip grad norm or None). The scheduler is not in
        it (it runs on the host after each step)."""
        loss, hits = self.forward_backward()
        if not optimizer:
            return loss, hits, None
        rep = self.rep
        norm = torch.nn.utils.clip_grad_norm_(rep.params, rep.optim.grad_clip, foreach=True)
        rep.opt.step()
        rep.zero_grad()
        return loss, hits, norm.detach()

    def capture(self, optimizer: bool = True, warm: int = 2, pool=None) -> None:
        """Run :meth:`body` ``warm`` times on a side stream (compiles, autograd's and the
        optimizer's lazy state, as torch asks before a capture), then capture it. The warm
        runs step the optimizer when ``optimizer``: the caller snapshots what must not move."""
        dev = torch.device(self.rep.device)
        with torch.cuda.device(dev):
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(warm):
                    self.body(optimizer)
                    if not optimizer:
                        self.rep.zero_grad()
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph, self.out = capture(lambda: self.body(optimizer), pool=pool)

    def replay(self) -> tuple[torch.Tensor, ...]:
        """One replay; (loss, hits, norm) copied out of the graph's static outputs (the next
        replay overwrites them)."""
        with _on(self.features.device):  # a replay runs on the current device's stream
            self.graph.replay()
            return tuple(t.clone() if t is not None else None for t in self.out)


def small_tensors(row: PackedRow, blocks: Blocks) -> dict[str, torch.Tensor]:
    """The row's tensors a step reads besides its features, by name."""
    return {**{n: getattr(row, n) for n in _ROW}, **{n: getattr(blocks, n) for n in _BLOCKS}}


def _on(device: torch.device):
    """The CUDA device context of ``device`` (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def graph_step_on(mode, device: str, drafters: int, nodes: int) -> bool:
    """``compile.cuda_graph_step`` resolved for one drafter device: whether its step is
    captured. ``on`` (the spec check refused it where it cannot apply) and ``auto`` both need
    a CUDA device, one drafter device and one node; ``off``: never. Every loss kind applies."""
    mode = {True: "on", False: "off"}.get(mode, mode)  # YAML reads a bare on/off as a bool
    return (mode in ("on", "auto") and device.startswith("cuda") and drafters == 1
            and nodes == 1)


def snapshot(rep) -> dict:
    """Copies of the replica's parameters and optimizer state (for restoring in place)."""
    return {"params": [p.detach().clone() for p in rep.params],
            "state": [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for s in (rep.opt.state[p] for p in rep.params)]}


def restore(rep, snap: dict) -> None:
    """Write ``snap`` back IN PLACE (a captured graph holds the tensors' addresses); optimizer
    state made after the snapshot (AdamW's lazy first step) goes back to its fresh zeros."""
    with torch.no_grad():
        for p, v in zip(rep.params, snap["params"]):
            p.copy_(v)
        for p, saved in zip(rep.params, snap["state"]):
            for k, v in rep.opt.state[p].items():
                if torch.is_tensor(v) and k in saved:
                    v.copy_(saved[k])
                elif torch.is_tensor(v):
                    v.zero_()


__all__ = ["GraphStep", "graph_step_on", "small_tensors", "snapshot", "restore"]
