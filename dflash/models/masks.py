"""The training objective's data layout: packed rows, blocks, the attention mask (the anchors and
loss weights that fill the blocks are the objective's: :mod:`dflash.train.anchors`).

One packed row holds several documents. From it we sample ``A`` anchors (a fixed number of slots so
shapes stay static for compiled code). Each anchor opens a block of ``B`` query tokens:
the anchor token followed by ``B-1`` mask tokens. Position ``k`` of a block predicts the token at
``anchor + k``; the anchor itself carries no label (it is given, as at inference).

Attention layout: queries = the ``A*B`` block tokens; keys = ``[L context features ; A*B block
tokens]``. The rule lives in exactly one place, :func:`make_mask_mod`; both the FlexAttention
BlockMask (CUDA) and the dense boolean mask (CPU/SDPA) are derived from it, so they cannot drift.
All functions accept unbatched tensors (``[L]``, ``[A]``) or a leading batch dimension.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

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
                    tile: int = 128, _compile: bool = False):
    """The mask as a FlexAttention BlockMask (batch dim = rows, broadcast over heads); ``tile``:
    the kernel's tile edge (FlexAttention's BLOCK_SIZE, not a DFlash block)."""
    n, Q, KV = mask_shape(doc_ids, blocks)
    device = device if device is not None else doc_ids.device
    mm = make_mask_mod(doc_ids.to(device), _blocks_to(blocks, device))
    return create_block_mask(mm, B=n, H=None, Q_LEN=Q, KV_LEN=KV, device=device,
                             BLOCK_SIZE=tile, _compile=_compile)


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


def document_block_mask(doc_ids: torch.Tensor, tile: int = 128, _compile: bool = False):
    """The same rule as a FlexAttention BlockMask [1, 1, L, L]: blocks of other documents are
    skipped, so attention costs what the documents need, not L². ``_compile``: build it with a
    compiled kernel (as the drafter's mask) instead of eager code that materialises [L, L]
    intermediates (a compile per row length: call it inside the compile gate)."""
    L = doc_ids.shape[-1]
    return create_block_mask(document_mask_mod(doc_ids), B=None, H=None, Q_LEN=L, KV_LEN=L,
                             device=doc_ids.device, BLOCK_SIZE=tile, _compile=_compile)


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


def _blocks_to(blocks: Blocks, device) -> Blocks:
    kw = {f.name: getattr(blocks, f.name) for f in fields(Blocks)}
    for name, v in kw.items():
        if isinstance(v, torch.Tensor):
            kw[name] = v.to(device)
    return Blocks(**kw)




__all__ = ["IGNORE_INDEX", "PackedRow", "Blocks", "make_mask_mod", "dense_mask",
           "flex_block_mask", "mask_shape", "document_mask_mod", "document_dense_mask",
           "document_block_mask", "attention_backend", "compiled_flex_attention"]
