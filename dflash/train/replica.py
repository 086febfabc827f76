"""One data-parallel drafter replica on one device: model, frozen embeddings, optimizer, step.

The same class is used by the warmup stage and the train stage, so warmup compiles exactly the
callables (same config, dtypes, feature width N·H, shape buckets) that training runs.
"""
from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models.drafter import DFlashConfig, DFlashDrafter
from ..models.graphs import capture_or_warn
from ..models.masks import Blocks, PackedRow, attention_backend, dense_mask, flex_block_mask
from ..models.target_output import TargetOutput
from .graph_step import GraphStep, restore, small_tensors, snapshot
from .head_loss import head_backend
from .host_pack import PackedLayout
from .objective import Objective

if TYPE_CHECKING:
    from ..spec.types import OptimSpec


@dataclass
class StepResult:
    loss: torch.Tensor  # 0-d, on the device: to the host with the step's readout (dflash.train.readout)
    labelled: int       # block positions that carried a loss
    tokens: int         # real target tokens in the packed row
    sample_ids: list[int]
    # per block position k: top-1 hits (device tensor, read with the loss) and labelled count
    hits: torch.Tensor | None = None
    counts: list[int] | None = None


def lr_lambda(total_steps: int, warmup_ratio: float, min_ratio: float = 0.0):
    """Linear warmup then cosine decay to ``min_ratio`` of the peak (0: to 0, the paper's
    recipe)."""
    warm = max(1, int(round(total_steps * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def make_optimizer(params: list, optim: OptimSpec, device: str, total_steps: int,
                   capturable: bool = False):
    """(AdamW, LambdaLR) of a replica. CUDA: the fused AdamW kernel (a launch or two for all
    parameters instead of a foreach chain per update term); CPU keeps foreach, so CPU runs stay
    bit-identical to before. ``capturable``: the step count and the learning rate live on the
    device (lr a 0-d tensor the scheduler fills in place), so the optimizer step can be
    captured in a CUDA graph and replayed with each step's lr; on CPU, where torch has no
    capturable AdamW, the same tensor lr with the single-tensor AdamW (the test's stand-in)."""
    o, fused = optim, device.startswith("cuda")
    lr = torch.tensor(o.lr, dtype=torch.float32, device=device) if capturable else o.lr
    kw = (dict(fused=fused or None, foreach=False, capturable=fused) if capturable
          else dict(foreach=not fused, fused=fused or None))
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, o.beta2), weight_decay=o.weight_decay,
                            **kw)
    return opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(total_steps, o.warmup_ratio, o.min_lr_ratio))


class DrafterReplica:
    """One replica. It takes its own config sections: the drafter config, the objective (block
    size, anchors, loss), the optimizer section, the compute dtype, the compile backend and
    ``compile.head_loss`` (resolved here for the replica's device)."""

    def __init__(self, index: int, device: str, cfg: DFlashConfig, objective: Objective,
                 optim: OptimSpec, dtype: torch.dtype, backend: str,
                 embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 init_state: dict | None, total_steps: int, head_loss="auto",
                 graph_step: bool = False):
        self.index, self.device, self.cfg = index, device, cfg
        self.objective = dataclasses.replace(
            objective, head_backend=head_backend(head_loss, backend, device))
        self.optim = optim
        self.attention = attention_backend(device)
        # fp32 master weights; bf16/fp16 compute through autocast on CUDA
        self.compute_dtype = dtype
        self.model = _drafter_on(device, cfg, self.attention, init_state)
        self.model.train()
        self.embed = embed_weight.to(device=device, dtype=self.compute_dtype)
        self.lm_head = (self.embed if lm_head_weight is embed_weight
                        else lm_head_weight.to(device=device, dtype=self.compute_dtype))
        self.params = [p for p in self.model.parameters()]
        # graph_step (compile.cuda_graph_step resolved): the whole step of each warmed bucket
        # is one CUDA graph (capture_step), so the optimizer keeps its lr and step on the device
        self.graph_step = graph_step
        self.graphs: dict[int, GraphStep | None] = {}
        self.graph_records: dict[int, dict] = {}      # bucket -> capture_step's record
        self._graph_norm: torch.Tensor | None = None  # the last replay's norm, for clip_and_step
        self._pool = None                             # one memory pool for every bucket's graph
        self.opt, self.sched = make_optimizer(self.params, optim, device, total_steps,
                                              capturable=graph_step)
        self.forward = (self.model.forward if backend == "eager" else
                        torch.compile(self.model.forward, backend=backend, dynamic=False))

    # ---- shapes and blocks (the objective's) -------------------------------------------------
    def num_slots(self, bucket_len: int) -> int:
        return self.objective.num_slots(bucket_len)

    def anchors(self, row: PackedRow, seed: int) -> Blocks:
        """The blocks this replica trains on ``row``: a pure function of (row, seed)."""
        return self.objective.anchors(row, seed)

    def signature(self, bucket_len: int) -> tuple:
        return ("drafter_step", self.device, bucket_len, self.num_slots(bucket_len))

    def autocast(self):
        """The compute-dtype context this replica's forward runs under (none for float32);
        evaluation that runs the drafter outside a step enters the same one."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(device_type=self.device.split(":")[0], dtype=self.compute_dtype)

    # ---- one forward + backward (grads accumulate in .grad; no state mutation before the
    #      compiled call, so a refused recompile can be retried safely) ----------------------
    def forward_backward(self, row: PackedRow, target: TargetOutput | torch.Tensor,
                         blocks: Blocks) -> StepResult:
        """``target``: the target worker's output for ``row`` (features, and soft labels when
        the objective distils); a bare feature tensor stands for features alone."""
        dev = self.device
        out = target if isinstance(target, TargetOutput) else TargetOutput(target)
        if self.graphs.get(row.input_ids.shape[0]) is not None:
            return self._replay(row, out, blocks)
        out = out.to(dev, non_blocking=True)
        small = small_tensors(row, blocks)  # one copy for the row's small tensors
        d = PackedLayout(small).to_device(small, dev)
        doc, ctx_pos = d.pop("doc_ids"), d.pop("position_ids")[None]
        blocks_d = Blocks(**d, block_size=blocks.block_size)
        loss, hits = self.forward_loss(
            doc, blocks_d, out.features, ctx_pos,
            lambda hidden: self.objective.loss(hidden, self.lm_head, blocks_d, out.soft,
                                               row_len=row.input_ids.shape[0], host=blocks))
        loss.backward()
        # counts from the host copies, and loss/hits stay device tensors: no host-device sync
        # here, so this thread goes on queueing work while the GPU runs the backward
        supervised = self.objective.supervised(blocks)
        tokens = int((row.doc_ids >= 0).sum())
        return StepResult(loss=loss.detach(), labelled=int(supervised.sum()), tokens=tokens,
                          sample_ids=list(row.sample_ids), hits=hits,
                          counts=supervised.sum(0).tolist())

    # ---- the captured step (compile.cuda_graph_step; dflash.train.graph_step) ---------------
    def capture_step(self, row: PackedRow, target: TargetOutput, blocks: Blocks) -> dict:
        """Capture the whole step of ``row``'s bucket as one CUDA graph (the caller holds the
        gate's exclusive side: the warm runs before the capture may compile). The weights and
        the optimizer state are put back in place afterwards, so a warm start trains from
        exactly the initial or checkpoint state. Returns the warm-up record's ``cuda_graph``
        entry; a failed capture is printed and recorded, and the bucket runs uncaptured."""
        L = row.input_ids.shape[0]
        stats: dict = {}

        def run() -> GraphStep:
            snap = snapshot(self)
            try:
                gs = GraphStep(self, row, target, blocks)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                gs.capture(optimizer=True, pool=self._pool)
                return gs
            finally:
                restore(self, snap)
                self.zero_grad()

        self.graphs[L] = capture_or_warn(run, stats, f"drafter {self.device} bucket {L}")
        self.graph_records[L] = {"captured": self.graphs[L] is not None, **stats}
        return self.graph_records[L]

    def _replay(self, row: PackedRow, out: TargetOutput, blocks: Blocks) -> StepResult:
        """The captured step: the row into the bucket's buffers, one replay (forward, backward,
        clip, AdamW, zero); clip_and_step then only advances the schedule."""
        gs = self.graphs[row.input_ids.shape[0]]
        gs.load(row, out, blocks)
        loss, hits, self._graph_norm = gs.replay()
        supervised = self.objective.supervised(blocks)
        return StepResult(loss=loss, labelled=int(supervised.sum()),
                          tokens=int((row.doc_ids >= 0).sum()), sample_ids=list(row.sample_ids),
                          hits=hits, counts=supervised.sum(0).tolist())

    def forward_loss(self, doc: torch.Tensor, blocks_d: Blocks, features: torch.Tensor,
                     ctx_pos: torch.Tensor, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask, the drafter's forward and ``loss_fn(hidden)`` -> (loss, hits) on tensors
        already on the device: the body both today's step and the captured step
        (:mod:`dflash.train.graph_step`) run."""
        if self.attention == "flex":
            mask = flex_block_mask(doc, blocks_d, device=self.device)
        else:
            mask = dense_mask(doc, blocks_d)[None]
        block_embeds = torch.nn.functional.embedding(blocks_d.block_input_ids, self.embed)[None]
        with self.autocast():
            hidden = self.forward(block_embeds, features, blocks_d.block_position_ids[None],
                                  ctx_pos, mask)
            return loss_fn(hidden)

    def zero_grad(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch._foreach_zero_([p.grad for p in self.params])  # one launch, not one per tensor

    def flat_grad(self) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])

    def set_flat_grad(self, flat: torch.Tensor) -> None:
        flat = flat.to(self.device, non_blocking=True)
        offset = 0
        for p in self.params:
            n = p.numel()
            if p.grad is not None:  # in place: a captured step holds the gradients' addresses
                p.grad.copy_(flat[offset:offset + n].view_as(p))
            else:
                p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n

    def clip_and_step(self) -> torch.Tensor:
        """Clip, step, zero; returns the pre-clip grad norm as a 0-d device tensor (no sync).
        After a replay the graph did all three: only the schedule advances here."""
        if self._graph_norm is not None:
            norm, self._graph_norm = self._graph_norm, None
            self.sched.step()
            return norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.optim.grad_clip,
                                              foreach=True)
        self.opt.step()
        self.sched.step()
        self.zero_grad()
        return norm.detach()

    def lr(self) -> float:
        lr = self.sched.get_last_lr()[0]
        if torch.is_tensor(lr):  # the capturable lr lives on the device: its value from the
            # schedule on the host (what LambdaLR filled in), not a device read
            return self.optim.lr * self.sched.lr_lambdas[0](self.sched.last_epoch)
        return lr


def _drafter_on(device: str, cfg: DFlashConfig, attention: str, init_state: dict | None):
    """The replica's drafter on ``device``; with ``init_state`` (every replica starts from the
    same weights) built on the meta device and materialised there, so its own random init (on
    the host) never runs: for the 8B pair's 1B-parameter drafter that init and the copy to the
    device were most of the warm-up's 43.6 s of set-up (round 8). The drafter holds parameters
    only (no buffers), so the loaded state overwrites every tensor ``to_empty`` left undefined."""
    if init_state is None:
        return DFlashDrafter(cfg, attention=attention, compile_flex=False).to(device)
    with torch.device("meta"):
        model = DFlashDrafter(cfg, attention=attention, compile_flex=False)
    if any(True for _ in model.buffers()):
        raise RuntimeError("DFlashDrafter has buffers: to_empty would leave them undefined")
    model = model.to_empty(device=device)
    model.load_state_dict(init_state, strict=True)
    return model
