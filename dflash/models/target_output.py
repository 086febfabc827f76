"""What a target worker hands a drafter for one packed row: the features, and the soft labels.

:class:`TargetOutput` is the one value that travels from the target side to the drafter side
(queue, feature cache, warm-up): the feature layers' hidden states ``[1, L, N·H]`` and, when the
objective distils (``loss.kind`` kd or ce+kd), the target's own next-token distribution as top-k
log-probs at the row positions whose next token is a response token (:func:`soft_positions`).
A soft label depends only on the absolute row position, so one target forward serves every
block offset of every anchor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def soft_positions(doc_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Row positions i whose next token (i+1) is a response token of the same document: the
    target's output at i is the soft label of every block label at i+1. Long[P], sorted."""
    doc, lm = doc_ids, loss_mask.bool()
    ok = (doc[:-1] >= 0) & (doc[:-1] == doc[1:]) & lm[1:]
    return torch.nonzero(ok, as_tuple=False).flatten()


def soft_positions_on(row, device) -> torch.Tensor:
    """:func:`soft_positions` of a packed row whose tensors are on the host, queued to
    ``device``: computed there (the host's ``nonzero`` needs no device) and copied pinned and
    non-blocking, so the target worker never waits for the work it queued before (a device
    ``nonzero`` syncs the stream; round 24's cached kd epochs read at 0.84x CE's speed on an
    H100 with it, and ``python -m bench.soft_read`` times this read against that one)."""
    pos = soft_positions(row.doc_ids.cpu(), row.loss_mask.cpu())
    if torch.device(device).type != "cuda":
        return pos.to(device)
    return pos.pin_memory().to(device, non_blocking=True)


@dataclass
class SoftLabels:
    """The target's top-k next-token log-probs at ``positions`` (row indices, sorted).

    ``logprobs`` are the full-vocabulary log-softmax values of the k most likely tokens (their
    exp sums to <= 1; the objective renormalises them), float32 for an exact loss."""

    positions: torch.Tensor  # Long[P]
    token_ids: torch.Tensor  # Int32[P, k] (vocabularies are < 2**31 tokens)
    logprobs: torch.Tensor   # Float[P, k]

    @property
    def top_k(self) -> int:
        return self.token_ids.shape[-1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.positions, self.token_ids, self.logprobs))

    def to(self, device, non_blocking: bool = False) -> "SoftLabels":
        return SoftLabels(*(t.to(device, non_blocking=non_blocking)
                            for t in (self.positions, self.token_ids, self.logprobs)))

    def at(self, row_positions: torch.Tensor, row_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_ids, logprobs) [n, k] of the soft labels at ``row_positions`` [n], which must
        all be among ``positions`` (a label's position minus one: always true for a label)."""
        slot = torch.full((row_len,), -1, dtype=torch.long, device=self.positions.device)
        slot[self.positions] = torch.arange(self.positions.numel(), device=slot.device)
        idx = slot[row_positions]
        return self.token_ids[idx], self.logprobs[idx]


@dataclass
class TargetOutput:
    """A target worker's result for one packed row."""

    features: torch.Tensor         # [1, L, N·H] in the target dtype (the drafter's fc input)
    soft: SoftLabels | None = None  # None unless the objective distils

    def nbytes(self) -> int:
        return (self.features.numel() * self.features.element_size()
                + (self.soft.nbytes() if self.soft is not None else 0))

    def to(self, device, non_blocking: bool = False) -> "TargetOutput":
        return TargetOutput(self.features.to(device, non_blocking=non_blocking),
                            self.soft.to(device, non_blocking) if self.soft is not None
                            else None)


__all__ = ["soft_positions", "soft_positions_on", "SoftLabels", "TargetOutput"]
