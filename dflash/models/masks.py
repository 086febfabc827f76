"""The training objective's data layout: packed rows, blocks, the attention mask (the anchors and
loss weights that fill the blocks are the objective's: :mod:`dflash.train.anchors`).

One packed row holds several documents. From it we sample ``A`` anchors (a fixed number of slots so
shapes stay static for compiled code). Each anchor opens a block of ``B`` query tokens:
the anchor token followed by ``B-1`` mask tokens. Position ``k`` of a block predicts the token at
``anchor + k``; the anchor itself carries no label (it is given, as at inference).

Attention layout: queries = the ``A*B`` block tokens; keys = ``[L context features ; A*B block
tokens]``. The rule lives in exactly one place, :func:`make_mask_mod`; the dense boolean mask
(CPU/SDPA) evaluates it, and the FlexAttention BlockMask (CUDA) applies it inside the tiles it
lists. Which tiles to list comes from the rows' structure, not from evaluating the rule densely:
every query sees at most two intervals of keys (its document's context before its anchor, its own
block), so the tile lists cost ``[Q, KV/128]`` integer comparisons instead of a ``[Q, KV]`` mask
(21.75 of a 58 ms step on the H200, and 236 s of the 8B target's cold compile, when built by
``create_block_mask``). Tests hold the tile lists to the rule (tests/test_masks.py).
All functions accept unbatched tensors (``[L]``, ``[A]``) or a leading batch dimension.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

IGNORE_INDEX = -100


@dataclass
class PackedRow:
    """One packed training row of bucket length ``L`` (documents back to back, then padding)."""

    input_ids: torch.Tensor     # Long[L]
    doc_ids: torch.Tensor       # Long[L]; document index within the row, -1 on padding
    position_ids: torch.Tensor  # Long[L]; position inside its own document (restarts at 0)
    loss_mask: torch.Tensor     # Bool[L]; True on response tokens
    sample_ids: list[int]


@dataclass
class Blocks:
    """``A`` anchor slots of ``B`` tokens each (flattened to ``A*B``); invalid slots are padding."""

    anchor_pos: torch.Tensor          # Long[A]   row index of each anchor (0 on invalid slots)
    valid: torch.Tensor               # Bool[A]
    block_input_ids: torch.Tensor     # Long[A*B] anchor token then B-1 mask tokens
    block_position_ids: torch.Tensor  # Long[A*B] position_ids[anchor] + k
    labels: torch.Tensor              # Long[A*B] token at anchor+k, IGNORE_INDEX where none
    block_doc: torch.Tensor           # Long[A]   document of the anchor (-1 on invalid slots)
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.anchor_pos.shape[-1]

    def to(self, device) -> "Blocks":
        """The same blocks with every tensor on ``device``."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    @classmethod
    def stack(cls, items: list["Blocks"]) -> "Blocks":
        """Stack per-row Blocks into a batch (leading dim = rows); all must share A and B."""
        out = {}
        for f in fields(cls):
            vals = [getattr(b, f.name) for b in items]
            out[f.name] = vals[0] if f.name == "block_size" else torch.stack(vals)
        return cls(**out)


# ---------------------------------------------------------------------------------------------
# anchors, blocks, labels
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# the attention rule (one mask_mod) and its two materialisations
# ---------------------------------------------------------------------------------------------
def _batched(doc_ids, anchor_pos, block_doc, valid):
    if doc_ids.dim() == 1:
        return doc_ids[None], anchor_pos[None], block_doc[None], valid[None], False
    return doc_ids, anchor_pos, block_doc, valid, True


def make_mask_mod(doc_ids: torch.Tensor, blocks: Blocks):
    """Build ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over queries [A*B] and keys [L + A*B].

    Query q belongs to block a = q // B. Key kv < L is context position j = kv: visible iff the
    slot is valid, j is in the block's document and j is strictly before the anchor (the block
    must not see its own labels). Key kv >= L is block token (kv-L): visible iff it is in the
    same block (bidirectional inside the block). Every query row sees at least its own block, so
    no row is fully masked (SDPA would give NaN). Indices are clamped because FlexAttention may
    evaluate the function on padded index ranges.
    """
    doc, anchor, bdoc, valid, _ = _batched(doc_ids, blocks.anchor_pos, blocks.block_doc,
                                           blocks.valid)
    L = doc.shape[-1]
    A = anchor.shape[-1]
    B = blocks.block_size
    Q = A * B

    def mask_mod(b, h, q_idx, kv_idx):
        a = torch.clamp(q_idx // B, 0, A - 1)
        j = torch.clamp(kv_idx, 0, L - 1)
        is_ctx = kv_idx < L
        ctx_ok = is_ctx & valid[b, a] & (doc[b, j] == bdoc[b, a]) & (kv_idx < anchor[b, a])
        blk_ok = (kv_idx >= L) & ((kv_idx - L) // B == q_idx // B)
        return (ctx_ok | blk_ok) & (q_idx < Q) & (kv_idx < L + Q)

    return mask_mod


def mask_shape(doc_ids: torch.Tensor, blocks: Blocks) -> tuple[int, int, int]:
    """(rows, Q, KV) of the attention problem."""
    n = 1 if doc_ids.dim() == 1 else doc_ids.shape[0]
    Q = blocks.anchor_pos.shape[-1] * blocks.block_size
    return n, Q, doc_ids.shape[-1] + Q


def dense_mask(doc_ids: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The mask as a BoolTensor [Q, L+Q] (or [N, Q, L+Q] when batched), True = may attend.

    Evaluates the same mask_mod on broadcast index grids (used with SDPA on CPU, where
    FlexAttention has no backward).
    """
    n, Q, KV = mask_shape(doc_ids, blocks)
    dev = doc_ids.device
    b = torch.arange(n, device=dev)[:, None, None]
    q = torch.arange(Q, device=dev)[None, :, None]
    kv = torch.arange(KV, device=dev)[None, None, :]
    m = make_mask_mod(doc_ids, blocks)(b, 0, q, kv)
    m = m.expand(n, Q, KV)
    return m if doc_ids.dim() > 1 else m[0]


def flex_block_mask(doc_ids: torch.Tensor, blocks: Blocks, *, device=None,
                    tile: int = 128) -> BlockMask:
    """The mask as a FlexAttention BlockMask (batch dim = rows, broadcast over heads); ``tile``:
    the kernel's tile edge (FlexAttention's BLOCK_SIZE, not a DFlash block). Built from the
    blocks' key intervals (static shapes, no host sync: it runs inside the captured step)."""
    n, Q, KV = mask_shape(doc_ids, blocks)
    device = device if device is not None else doc_ids.device
    doc_ids, blocks = doc_ids.to(device), blocks.to(device)
    doc, anchor, _, valid, _ = _batched(doc_ids, blocks.anchor_pos, blocks.block_doc,
                                        blocks.valid)
    L, B = doc.shape[-1], blocks.block_size
    a = torch.arange(Q, device=device) // B                       # the block of each query
    p, ok = anchor[:, a], valid[:, a]                             # [n, Q]: its anchor, valid
    # the context: [start of the anchor's document, anchor); nothing on an invalid slot
    ctx_lo = torch.where(ok, _document_start(doc).gather(1, p), 0)
    ctx_hi = torch.where(ok, p, 0)
    blk_lo = (L + a * B).expand(n, Q)                             # the query's own block
    mm = make_mask_mod(doc_ids, blocks)
    return _interval_block_mask((ctx_lo, ctx_hi), (blk_lo, blk_lo + B), KV, tile, mm)


# ---------------------------------------------------------------------------------------------
# the target's rule: causal inside each document of a packed row (one mask_mod, two forms)
# ---------------------------------------------------------------------------------------------
def document_mask_mod(doc_ids: torch.Tensor):
    """``mask_mod`` for the target over a packed row: a token sees the earlier tokens of its own
    document. Padding (doc -1) sees itself only, so no row is fully masked (SDPA would give NaN).
    Exact: each document's hidden states equal those of the document run alone (tested)."""
    L = doc_ids.shape[-1]

    def mask_mod(b, h, q_idx, kv_idx):
        q = torch.clamp(q_idx, 0, L - 1)
        kv = torch.clamp(kv_idx, 0, L - 1)
        dq = doc_ids[q]
        return ((dq == doc_ids[kv]) & (q_idx >= kv_idx) & (dq >= 0)) | (q_idx == kv_idx)

    return mask_mod


def document_dense_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[1, 1, L, L] BoolTensor (True = attend) for SDPA, from :func:`document_mask_mod`."""
    idx = torch.arange(doc_ids.shape[-1], device=doc_ids.device)
    return document_mask_mod(doc_ids)(0, 0, idx[:, None], idx[None, :])[None, None]


def document_block_mask(doc_ids: torch.Tensor, tile: int = 128) -> BlockMask:
    """The same rule as a FlexAttention BlockMask [1, 1, L, L]: blocks of other documents are
    skipped, so attention costs what the documents need, not L². Built from the documents' key
    intervals (each token sees [its document's start, itself]; padding itself only): no compile
    and no [L, L] intermediate, so the compiled target's cold start has no mask graph to build."""
    L = doc_ids.shape[-1]
    q = torch.arange(L, device=doc_ids.device)
    lo = torch.where(doc_ids >= 0, _document_start(doc_ids[None])[0], q)
    empty = torch.zeros_like(q)
    return _interval_block_mask((lo[None], q[None] + 1), (empty[None], empty[None]), L, tile,
                                document_mask_mod(doc_ids))


# ---------------------------------------------------------------------------------------------
# BlockMasks from key intervals (no dense evaluation of the rule)
# ---------------------------------------------------------------------------------------------
def _document_start(doc: torch.Tensor) -> torch.Tensor:
    """[n, L] -> [n, L]: the index where each position's document starts (documents of a packed
    row are contiguous: a new document begins wherever the id changes)."""
    idx = torch.arange(doc.shape[-1], device=doc.device).expand_as(doc)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return torch.where(new, idx, 0).cummax(-1).values


def _interval_block_mask(first, second, kv_len: int, tile: int, mask_mod) -> BlockMask:
    """A BlockMask whose query q sees keys ``[lo, hi)`` of ``first`` and of ``second`` (each a
    pair of [n, Q] tensors; lo >= hi is empty), refined inside partial tiles by ``mask_mod``.
    A tile is listed as full where every query of the tile sees every key of it (``mask_mod`` is
    skipped there), as partial where some query sees some key; the rest is skipped. Exact when
    ``mask_mod`` is true exactly on the intervals (tests/test_masks.py holds both to the rule)."""
    n, q_len = first[0].shape
    qt, kvt = -(-q_len // tile), -(-kv_len // tile)
    pad = qt * tile - q_len
    ks = torch.arange(kvt, device=first[0].device) * tile          # each key tile's [ks, ke)
    ke = (ks + tile).clamp(max=kv_len)
    some = every = None
    for lo, hi in (first, second):
        lo, hi = (torch.nn.functional.pad(t, (0, pad)) for t in (lo, hi))  # padded q: empty
        lo, hi = lo[..., None], hi[..., None]
        s = (lo < ke) & (hi > ks) & (hi > lo)
        e = (lo <= ks) & (hi >= ke)
        some, every = (s, e) if some is None else (some | s, every | e)
    real = (torch.arange(qt * tile, device=ks.device) < q_len)[None, :, None]
    some = some.view(n, qt, tile, kvt).any(2)
    every = (every | ~real).view(n, qt, tile, kvt).all(2) & some
    partial_n, partial_i = _tile_list(some & ~every)
    full_n, full_i = _tile_list(every)
    return BlockMask.from_kv_blocks(partial_n, partial_i, full_n, full_i, BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


def _tile_list(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool[n, QT, KVT] -> (count [n, 1, QT], indices [n, 1, QT, KVT]) int32, the listed key
    tiles first in ascending order: FlexAttention's ordered form."""
    order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
    return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]


def attention_backend(device: str) -> str:
    """The one rule for drafter and target alike. CUDA: compiled flex_attention with a BlockMask
    (blocks nobody attends are skipped; a dense 4-D mask would push SDPA off its flash kernel
    onto full L² attention). CPU: SDPA with the dense mask of the same mask_mod (FlexAttention
    has no backward on CPU in torch 2.13, and the target then starts without a compile)."""
    return "flex" if device.startswith("cuda") else "sdpa"


@functools.cache
def compiled_flex_attention():
    """The process's one compiled ``flex_attention`` (static shapes: a graph per shape bucket),
    shared by the target layers and the drafter's standalone attention. Its compiles run inside
    ``gate.run`` like every other compile."""
    return torch.compile(flex_attention, dynamic=False)


__all__ = ["IGNORE_INDEX", "PackedRow", "Blocks", "make_mask_mod", "dense_mask",
           "flex_block_mask", "mask_shape", "document_mask_mod", "document_dense_mask",
           "document_block_mask", "attention_backend", "compiled_flex_attention"]
