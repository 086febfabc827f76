"""The drafter's training objective: one frozen owner of its numbers and of its loss.

:class:`Objective` holds the block size and mask token (from the drafter config), the anchor
count and token budget (``batching``) and the loss section (γ, kind, supervised positions,
soft-label top-k). It answers everything the replica, the scheduler and the warm-up ask about
the objective: anchor slots per bucket, the blocks of a row (:meth:`Objective.anchors`), the
loss weight of every block token and the loss itself.

Loss kinds (``loss.kind``):
- ``ce``: cross-entropy on the sampled answer tokens (the reference recipe);
- ``kd``: forward KL to the target's own next-token distribution (top-k, renormalised) at the
  label's position: the soft labels of :class:`dflash.models.target_output.SoftLabels`;
- ``ce+kd``: the mean of the two.
Every kind uses the same γ weights w_k = exp(−(k−1)/γ), k = 1..B−1, and ``loss.max_position``
K keeps only k ≤ K (weights above K are 0, so the head never runs there). The loss is
Σ w·loss / Σ w over the supervised positions. ``head_backend`` (``compile.head_loss`` resolved
for the replica's device, :func:`dflash.train.head_loss.head_backend`) runs the head's chunks
as one compiled graph; None runs them as eager torch ops.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.masks import IGNORE_INDEX, Blocks, PackedRow
from ..models.target_output import SoftLabels
from .anchors import block_loss_weights, loss_weights, sample_anchors
from .head_loss import balanced_chunk, head_cross_entropy

KINDS = ("ce", "kd", "ce+kd")
SOFT_KINDS = ("kd", "ce+kd")  # the kinds whose target worker produces soft labels


@dataclass(frozen=True)
class Objective:
    block_size: int
    mask_token_id: int
    max_anchors: int
    token_budget: int
    gamma: float
    kind: str = "ce"
    max_position: int | None = None  # None: every block position k >= 1 carries loss
    top_k: int = 32                  # soft labels kept per position (kd, ce+kd)
    head_backend: str | None = None  # torch.compile backend of the head's chunks; None: eager
    head_chunk: int = 2048           # rows per chunk of the head (compile.head_chunk)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind {self.kind!r}: expected one of {', '.join(KINDS)}")

    @classmethod
    def of(cls, drafter_cfg, batching, loss) -> "Objective":
        """From the drafter config (block size, mask id) and the spec's batching and loss."""
        return cls(block_size=drafter_cfg.block_size, mask_token_id=drafter_cfg.mask_token_id,
                   max_anchors=batching.max_anchors, token_budget=batching.token_budget,
                   gamma=loss.gamma, kind=loss.kind, max_position=loss.max_position,
                   top_k=loss.kd_top_k)

    @property
    def soft_labels(self) -> bool:
        """Whether the target must produce its soft labels (kd, ce+kd)."""
        return self.kind in SOFT_KINDS

    # ---- blocks ------------------------------------------------------------------------------
    def num_slots(self, bucket_len: int) -> int:
        """Anchor slots for a bucket: max_anchors scaled to the bucket (static per bucket)."""
        return max(1, self.max_anchors * bucket_len // self.token_budget)

    def anchors(self, row: PackedRow, seed: int) -> Blocks:
        """The blocks of ``row``: anchors a pure function of (row, seed)."""
        return sample_anchors(row, self.num_slots(row.input_ids.shape[0]), self.block_size,
                              torch.Generator().manual_seed(seed), self.mask_token_id)

    def weights(self, blocks: Blocks) -> torch.Tensor:
        """Loss weight of every block token (shape of ``blocks.labels``), 0 where unsupervised."""
        return block_loss_weights(blocks, self.gamma, self.max_position)

    def supervised(self, blocks: Blocks) -> torch.Tensor:
        """Bool [..., A, B]: block tokens that carry loss (a label, k <= max_position)."""
        B = self.block_size
        has = (blocks.labels != IGNORE_INDEX).reshape(*blocks.labels.shape[:-1], -1, B)
        if self.max_position is not None:
            has = has & (torch.arange(B, device=has.device) <= self.max_position)
        return has

    # ---- loss --------------------------------------------------------------------------------
    def loss(self, hidden: torch.Tensor, lm_head: torch.Tensor, blocks: Blocks,
             soft: SoftLabels | None = None, row_len: int | None = None,
             chunk: int | None = None, host: Blocks | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, hits) for one row's blocks: hidden [1, A*B, H] (or [A*B, H]) of the drafter,
        the frozen head [V, H], the blocks (on hidden's device) and, for kd / ce+kd, the row's
        soft labels (``row_len`` = L). hits [B]: supervised positions whose top-1 equals the
        label, per block position (no gradient). ``host``: the same blocks on the CPU (the
        replica has them): the supervised rows are then found there, without a device sync.
        ``chunk``: rows per chunk of the head (default ``head_chunk``)."""
        B, chunk = self.block_size, chunk or self.head_chunk
        h = hidden.reshape(-1, hidden.shape[-1])
        keep, k, y, w = self._rows(host if host is not None else blocks, h.device)
        hits = torch.zeros(B, dtype=torch.float32, device=h.device)
        if keep.numel() == 0:
            return h.sum() * 0.0, hits  # keeps the graph (and the gradient mean) whole
        h = h[keep]
        ids, p, const = self._targets(y, keep, k, blocks, soft, row_len)
        if self.head_backend is not None:  # equal chunks that tile the bucket's most rows
            chunk = balanced_chunk(self.max_supervised(hidden.numel() // hidden.shape[-1]),
                                   chunk)
        total, hits = head_cross_entropy(h, lm_head, ids, p, w, y, k, B, chunk,
                                         self.head_backend)
        return (total + (const * w).sum()) / w.sum(), hits

    def static_loss(self, hidden: torch.Tensor, lm_head: torch.Tensor, blocks: Blocks,
                    chunk: int | None = None, position_weights: torch.Tensor | None = None,
                    soft: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`loss` over a fixed set of block tokens: every slot's positions k = 1..K
        (K = ``max_position``, else B−1), weight 0 where there is no label. Nothing depends on
        which tokens carry a label (no host-side selection, no data-dependent shape), so one
        bucket's step has one shape and a CUDA graph can hold it
        (:mod:`dflash.train.graph_step`). Its rows are :meth:`max_supervised`'s, the ones the
        compiled head pads to, so it costs what a full row costs there; the loss, hits and
        gradient equal :meth:`loss`'s (the unlabelled rows add zero to each).
        ``position_weights``: :meth:`position_weights` already on the device (inside a CUDA
        graph nothing may be copied from the host). ``soft`` (kd, ce+kd): the row's soft labels
        as dense [L, top_k] ids and log-probs by row position (:meth:`dense_soft`), so the
        labels of every slot are a gather, not the host-side lookup :meth:`loss` does."""
        if self.soft_labels and soft is None:
            raise ValueError(f"loss.kind {self.kind!r} needs the row's dense soft labels")
        B, Hd, chunk = self.block_size, hidden.shape[-1], chunk or self.head_chunk
        K = B - 1 if self.max_position is None else min(self.max_position, B - 1)

        def sel(t):  # [A*B, ...] -> the rows k = 1..K of every slot, [A*K, ...]
            return t.reshape(-1, B, *t.shape[1:])[:, 1:K + 1].reshape(-1, *t.shape[1:])

        h = sel(hidden.reshape(-1, Hd))
        y = sel(blocks.labels.reshape(-1))
        wk = (position_weights if position_weights is not None
              else self.position_weights(h.device))[1:K + 1]
        A = h.shape[0] // max(K, 1)
        w = torch.where(y != IGNORE_INDEX, wk.repeat(A), torch.zeros_like(wk).repeat(A))
        k = torch.arange(1, K + 1, device=h.device).repeat(A)
        ids = y.clamp(min=0)[:, None]   # unlabelled rows: any id, weight 0 (label stays −100)
        p = torch.ones(y.shape[0], 1, device=h.device)
        const = None  # soft CE -> KL (kd, ce+kd); CE's step adds nothing for it
        if self.soft_labels:  # the target's output one before each label, by row position
            dense_ids, dense_lp = soft
            # every slot's anchor K times (expand, not repeat_interleave: no host sync inside
            # a capture); an unlabelled slot's position may fall off the row
            anchor = blocks.anchor_pos.reshape(-1, 1).expand(-1, K).reshape(-1)
            at = (anchor + k - 1).clamp(0, dense_ids.shape[0] - 1)
            ids, p, const = self._distilled(ids, p, dense_ids[at], dense_lp[at])
        if self.head_backend is not None:
            chunk = balanced_chunk(h.shape[0], chunk)   # the compiled path's chunk, = loss()'s
        total, hits = head_cross_entropy(h, lm_head, ids, p, w, y, k, B, chunk,
                                         self.head_backend)
        if const is not None:
            total = total + (const * w).sum()
        # no labelled token at all: 0 / tiny = 0, as loss() gives, with a zero gradient
        return total / w.sum().clamp(min=torch.finfo(torch.float32).tiny), hits

    def dense_soft(self, soft: SoftLabels, row_len: int, out=None, device=None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's soft labels as dense [row_len, top_k] ids (int32) and log-probs (float32)
        by row position, zeros where the target gave none (only unlabelled slots read those, at
        weight 0): written into ``out`` (a captured step's static buffers) when given, else
        into new tensors on ``device`` (default: the soft labels')."""
        if out is None:
            dev = device or soft.positions.device
            out = tuple(torch.zeros(row_len, self.top_k, dtype=dt, device=dev)
                        for dt in (torch.int32, torch.float32))
        for buf, src in zip(out, (soft.token_ids, soft.logprobs)):
            buf.zero_()
            buf.index_copy_(0, soft.positions.to(buf.device, non_blocking=True),
                            src.to(buf.device, buf.dtype, non_blocking=True))
        return out

    def position_weights(self, device=None) -> torch.Tensor:
        """Float [B]: the loss weight of each block position (0 at k = 0 and above the cap)."""
        return loss_weights(self.block_size, self.gamma, self.max_position).to(device)

    def max_supervised(self, block_tokens: int) -> int:
        """The most supervised positions ``block_tokens`` (A·B) can hold: every block full."""
        per_block = int((loss_weights(self.block_size, self.gamma, self.max_position) > 0).sum())
        return block_tokens // self.block_size * per_block

    def _rows(self, blocks: Blocks, device) -> tuple[torch.Tensor, ...]:
        """(row index, block position k, label, weight) of every supervised block token, found
        where ``blocks`` live (a host copy: no sync; the count is known there) and then moved
        to ``device`` without waiting."""
        w = self.weights(blocks).reshape(-1).float()
        keep = torch.nonzero(w > 0, as_tuple=False).flatten()
        rows = (keep, keep % self.block_size, blocks.labels.reshape(-1)[keep], w[keep])
        return tuple(t.to(device, non_blocking=True) for t in rows)

    def _targets(self, y, keep, k, blocks, soft, row_len):
        """The target distribution per supervised position as (ids [n, m], p [n, m]) and the
        constant that turns soft CE into KL (Σ p log p of the distilled part; no gradient)."""
        ones = torch.ones(y.shape[0], 1, device=y.device)
        if self.kind == "ce":
            return y[:, None], ones, torch.zeros_like(ones[:, 0])
        if soft is None or row_len is None:
            raise ValueError(f"loss.kind {self.kind!r} needs the target's soft labels")
        anchor = blocks.anchor_pos.reshape(-1)[keep // self.block_size]
        ids, lp = soft.at(anchor + k - 1, row_len)   # the target's output one before the label
        return self._distilled(y[:, None], ones, ids, lp)

    def _distilled(self, hard_ids, ones, ids, lp):
        """(ids, p, constant) of kd / ce+kd from the top-k soft labels ``ids``/``lp`` [n, k]
        (renormalised here), beside the hard labels ``hard_ids`` [n, 1] for ce+kd."""
        lp = torch.log_softmax(lp.float(), dim=-1)   # top-k renormalised
        pk = lp.exp()
        neg_entropy = (pk * lp).sum(-1)
        ids = ids.long()
        if self.kind == "kd":
            return ids, pk, neg_entropy
        return (torch.cat([hard_ids, ids], 1), torch.cat([ones, pk], 1) * 0.5,
                0.5 * neg_entropy)


__all__ = ["KINDS", "SOFT_KINDS", "Objective"]
