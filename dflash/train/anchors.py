"""The DFlash objective's anchors and loss weights: which positions open a block, the blocks
and labels sampled from a packed row, and the per-position weights w_k = exp(-(k-1)/γ). Only
the objective (:mod:`dflash.train.objective`) uses them; the layout they fill (PackedRow,
Blocks, the attention mask) is :mod:`dflash.models.masks`'s.
"""
from __future__ import annotations

import torch

from ..models.masks import IGNORE_INDEX, Blocks, PackedRow


def anchor_candidates(row: PackedRow) -> torch.Tensor:
    """Positions p that may anchor a block: p is a response token and p+1 carries a label.

    A label at p+1 needs the same document and a response token there (prompt tokens were not
    produced by the target, so the drafter is not trained to predict them). Without this the
    block would carry no loss at all and waste a slot.
    """
    doc, lm = row.doc_ids, row.loss_mask.bool()
    ok = lm[:-1] & lm[1:] & (doc[:-1] >= 0) & (doc[:-1] == doc[1:])
    return torch.nonzero(ok, as_tuple=False).flatten()


def sample_anchors(row: PackedRow, num_slots: int, block_size: int,
                   generator: torch.Generator | None, mask_token_id: int) -> Blocks:
    """Sample up to ``num_slots`` anchors uniformly without replacement; build blocks + labels."""
    L = row.input_ids.shape[0]
    A, B = num_slots, block_size
    cand = anchor_candidates(row)
    n = min(A, cand.numel())
    pick = torch.randperm(cand.numel(), generator=generator)[:n]
    # sorted anchors keep block tokens in row order: nicer for block-sparse kernels and debugging
    chosen = torch.sort(cand[pick]).values

    anchor_pos = torch.zeros(A, dtype=torch.long)
    anchor_pos[:n] = chosen
    valid = torch.zeros(A, dtype=torch.bool)
    valid[:n] = True
    block_doc = torch.where(valid, row.doc_ids[anchor_pos], torch.full_like(anchor_pos, -1))

    k = torch.arange(B)
    idx = anchor_pos[:, None] + k[None, :]                     # [A, B] row index of anchor+k
    idx_c = idx.clamp(max=L - 1)
    in_doc = (idx < L) & (row.doc_ids[idx_c] == block_doc[:, None]) & valid[:, None]
    labelled = in_doc & row.loss_mask.bool()[idx_c] & (k[None, :] > 0)
    labels = torch.where(labelled, row.input_ids[idx_c], torch.full_like(idx, IGNORE_INDEX))

    block_ids = torch.full((A, B), mask_token_id, dtype=torch.long)
    block_ids[:, 0] = torch.where(valid, row.input_ids[anchor_pos],
                                  torch.full_like(anchor_pos, mask_token_id))
    # the block continues its document's positions, exactly as at inference time
    block_pos = row.position_ids[anchor_pos][:, None] + k[None, :]
    block_pos = torch.where(valid[:, None], block_pos, k[None, :].expand(A, B))

    return Blocks(anchor_pos=anchor_pos, valid=valid, block_input_ids=block_ids.flatten(),
                  block_position_ids=block_pos.flatten(), labels=labels.flatten(),
                  block_doc=block_doc, block_size=B)


def loss_weights(block_size: int, gamma: float, max_position: int | None = None
                 ) -> torch.Tensor:
    """Per block position weight: w_0 = 0 (the anchor is given), w_k = exp(-(k-1)/gamma), and
    0 above ``max_position`` (those positions are not supervised at all).

    Early positions matter most: a draft is only accepted up to its first miss.
    """
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    if max_position is not None:
        w[max_position + 1:] = 0.0
    return w


def block_loss_weights(blocks: Blocks, gamma: float, max_position: int | None = None
                       ) -> torch.Tensor:
    """Loss weight of every block token (shape of ``blocks.labels``), zero where unlabelled."""
    w = loss_weights(blocks.block_size, gamma, max_position).to(blocks.labels.device)
    w = w.repeat(blocks.labels.shape[-1] // blocks.block_size)
    w = w.expand_as(blocks.labels)
    return torch.where(blocks.labels != IGNORE_INDEX, w, torch.zeros_like(w))


__all__ = ["anchor_candidates", "sample_anchors", "loss_weights", "block_loss_weights"]
