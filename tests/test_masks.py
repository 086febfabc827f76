"""Anchors, labels, loss weights and the attention mask against plain-Python references."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash.models.masks import (IGNORE_INDEX, Blocks, PackedRow, dense_mask, document_block_mask,
                                 document_dense_mask, document_mask_mod, flex_block_mask)
from dflash.train.anchors import anchor_candidates, block_loss_weights, loss_weights, sample_anchors

MASK = 999


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny tensors: one intra-op thread is faster and robust to a busy machine."""


def make_row(doc_lens, pad, prompt_lens, seed=0):
    """Documents back to back; the first prompt_lens[d] tokens of doc d are prompt."""
    g = torch.Generator().manual_seed(seed)
    doc, pos, lm = [], [], []
    for d, (n, p) in enumerate(zip(doc_lens, prompt_lens)):
        doc += [d] * n
        pos += list(range(n))
        lm += [False] * p + [True] * (n - p)
    doc += [-1] * pad
    pos += [0] * pad
    lm += [False] * pad
    L = len(doc)
    return PackedRow(input_ids=torch.randint(0, 500, (L,), generator=g),
                     doc_ids=torch.tensor(doc), position_ids=torch.tensor(pos),
                     loss_mask=torch.tensor(lm), sample_ids=list(range(len(doc_lens))))


def manual_blocks(row, anchors, num_slots, B):
    """Blocks for hand-picked anchors (pads the remaining slots as sample_anchors does)."""
    L = row.input_ids.numel()
    A = num_slots
    anchor_pos = torch.zeros(A, dtype=torch.long)
    anchor_pos[:len(anchors)] = torch.tensor(anchors, dtype=torch.long)
    valid = torch.arange(A) < len(anchors)
    block_doc = torch.where(valid, row.doc_ids[anchor_pos], torch.full((A,), -1))
    ids = torch.full((A, B), MASK)
    pos = torch.arange(B).repeat(A, 1)
    lab = torch.full((A, B), IGNORE_INDEX)
    for a, p in enumerate(anchors):
        ids[a, 0] = row.input_ids[p]
        pos[a] = row.position_ids[p] + torch.arange(B)
        for k in range(1, B):
            if p + k < L and row.doc_ids[p + k] == row.doc_ids[p] and row.loss_mask[p + k]:
                lab[a, k] = row.input_ids[p + k]
    return Blocks(anchor_pos, valid, ids.flatten(), pos.flatten(), lab.flatten(), block_doc, B)


def reference_mask(row, blocks):
    """The rule, written with loops: the independent oracle for mask_mod."""
    L = row.doc_ids.numel()
    A, B = blocks.num_slots, blocks.block_size
    Q = A * B
    m = torch.zeros(Q, L + Q, dtype=torch.bool)
    for q in range(Q):
        a = q // B
        if blocks.valid[a]:
            anc = int(blocks.anchor_pos[a])
            for j in range(L):
                if int(row.doc_ids[j]) == int(row.doc_ids[anc]) and j < anc:
                    m[q, j] = True
        for t in range(Q):
            if t // B == a:
                m[q, L + t] = True
    return m


CASES = [
    # (doc_lens, pad, prompt_lens, anchors, slots, B)
    ([12], 0, [2], [2, 10], 3, 4),                   # anchor near end of the only doc
    ([6, 7, 5], 3, [1, 2, 1], [1, 4, 6 + 2, 13 + 1, 13 + 3], 6, 4),  # several docs + padding
    ([5, 5], 2, [0, 0], [0, 5], 2, 3),               # anchors at document starts (no context)
    ([8, 8], 0, [1, 1], [3, 8 + 3], 2, 5),           # same in-doc position in two docs
    ([4], 4, [1], [], 2, 4),                         # no anchor at all: only padded slots
]


@pytest.mark.parametrize("case", CASES)
def test_dense_mask_matches_loop_reference(case):
    doc_lens, pad, prompt, anchors, A, B = case
    row = make_row(doc_lens, pad, prompt)
    bl = manual_blocks(row, anchors, A, B)
    ref = reference_mask(row, bl)
    got = dense_mask(row.doc_ids, bl)
    assert torch.equal(got, ref)
    assert got.any(-1).all(), "a fully masked query row would make SDPA return NaN"


@pytest.mark.parametrize("case", CASES[:4])
def test_flex_block_mask_matches_dense(case):
    doc_lens, pad, prompt, anchors, A, B = case
    row = make_row(doc_lens, pad, prompt)
    bl = manual_blocks(row, anchors, A, B)
    dm = dense_mask(row.doc_ids, bl)
    # BLOCK_SIZE=1: the BlockMask's block-level dense form is the element mask itself
    bm = flex_block_mask(row.doc_ids, bl, tile=1)
    assert torch.equal(bm.to_dense()[0, 0].bool(), dm)
    # default 128-blocks: attention output equals SDPA with the dense mask
    bm = flex_block_mask(row.doc_ids, bl)
    g = torch.Generator().manual_seed(1)
    Q, KV = dm.shape
    q = torch.randn(1, 4, Q, 16, generator=g)
    k = torch.randn(1, 2, KV, 16, generator=g)
    v = torch.randn(1, 2, KV, 16, generator=g)
    out_flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    out_sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dm, enable_gqa=True)
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)


def test_batched_mask_is_per_row():
    rows = [make_row([6, 7], 3, [1, 1], seed=0), make_row([16], 0, [3], seed=1)]
    g = torch.Generator().manual_seed(0)
    bls = [sample_anchors(r, 4, 3, g, MASK) for r in rows]
    doc = torch.stack([r.doc_ids for r in rows])
    got = dense_mask(doc, Blocks.stack(bls))
    for i, (r, b) in enumerate(zip(rows, bls)):
        assert torch.equal(got[i], reference_mask(r, b))
    bm = flex_block_mask(doc, Blocks.stack(bls), tile=1)
    assert torch.equal(bm.to_dense()[:, 0].bool(), got)


def test_sample_anchors_labels_and_positions():
    row = make_row([10, 9, 7], 4, [3, 2, 6])
    g = torch.Generator().manual_seed(0)
    A, B = 20, 4
    bl = sample_anchors(row, A, B, g, MASK)
    cand = set(anchor_candidates(row).tolist())
    n_valid = int(bl.valid.sum())
    assert n_valid == len(cand) < A                     # everything eligible, rest padded
    anchors = bl.anchor_pos[bl.valid].tolist()
    assert len(set(anchors)) == n_valid and set(anchors) == cand   # without replacement
    ids = bl.block_input_ids.view(A, B)
    pos = bl.block_position_ids.view(A, B)
    lab = bl.labels.view(A, B)
    for a in range(A):
        assert (ids[a, 1:] == MASK).all()
        assert lab[a, 0] == IGNORE_INDEX                 # the anchor carries no label
        if not bl.valid[a]:
            assert (lab[a] == IGNORE_INDEX).all() and bl.block_doc[a] == -1
            continue
        p = int(bl.anchor_pos[a])
        assert row.loss_mask[p] and ids[a, 0] == row.input_ids[p]
        assert bl.block_doc[a] == row.doc_ids[p]
        assert torch.equal(pos[a], row.position_ids[p] + torch.arange(B))
        assert lab[a, 1] != IGNORE_INDEX                 # at least one label per valid block
        for k in range(1, B):
            same = p + k < row.doc_ids.numel() and row.doc_ids[p + k] == row.doc_ids[p]
            if same:
                assert lab[a, k] == row.input_ids[p + k]  # position k predicts token at anchor+k
            else:
                assert lab[a, k] == IGNORE_INDEX         # never across the document's end
    # the last token of a doc can never anchor (nothing to predict)
    ends = [9, 18, 25]
    assert not cand & set(ends)


def test_sample_anchors_uniform_and_capped():
    row = make_row([40], 0, [10])
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(40)
    for _ in range(300):
        bl = sample_anchors(row, 5, 4, g, MASK)
        assert bl.valid.all()
        counts[bl.anchor_pos] += 1
    eligible = counts[10:39]
    assert counts[:10].sum() == 0 and counts[39] == 0
    assert eligible.min() > 0.4 * eligible.mean()       # roughly uniform (mean ~ 51.7)


def test_loss_weights():
    w = loss_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    row = make_row([12], 0, [2])
    bl = sample_anchors(row, 3, 4, torch.Generator().manual_seed(0), MASK)
    bw = block_loss_weights(bl, 7.0)
    assert torch.equal(bw > 0, bl.labels != IGNORE_INDEX)


def _tile_truth(dense: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(some, every) Bool[n, QT, KVT] from an element mask [n, Q, KV]: the rule's own answer to
    "does this tile need the kernel" (over the real positions of edge tiles only)."""
    n, Q, KV = dense.shape
    qt, kvt = -(-Q // tile), -(-KV // tile)
    some = torch.zeros(n, qt, kvt, dtype=torch.bool)
    every = torch.zeros_like(some)
    for i in range(qt):
        for j in range(kvt):
            t = dense[:, i * tile:(i + 1) * tile, j * tile:(j + 1) * tile]
            some[:, i, j] = t.flatten(1).any(1)
            every[:, i, j] = t.flatten(1).all(1)
    return some, every


def _tiles_of(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, full) Bool[n, QT, KVT] of a BlockMask (partial + full, and full alone)."""
    def dense(num, idx):
        n, _, qt, kvt = idx.shape
        out = torch.zeros(n, qt, kvt, dtype=torch.bool)
        for b in range(n):
            for i in range(qt):
                out[b, i, idx[b, 0, i, :num[b, 0, i]].long()] = True
        return out
    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices)
    return dense(bm.kv_num_blocks, bm.kv_indices) | full, full


@pytest.mark.parametrize("tile", [4, 8, 16])
@pytest.mark.parametrize("seed", range(4))
def test_flex_tiles_are_exactly_the_rule_s_tiles(seed, tile):
    """The drafter's BlockMask lists a tile iff the rule lets some query of it see some key, and
    marks it full (mask_mod skipped) iff every query sees every key: built from the blocks'
    key intervals, it must agree with the dense rule on sampled rows (several documents,
    padding, slots left invalid, query/key lengths that are not multiples of the tile)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
    rows = [make_row(lens.tolist(), int(seed % 3) * 3, [1] * len(lens), seed=seed + i)
            for i in range(2)]
    B = 4 if tile % 4 == 0 else 2
    bls = [sample_anchors(r, 9, B, g, MASK) for r in rows]
    doc, bl = torch.stack([r.doc_ids for r in rows]), Blocks.stack(bls)
    some, every = _tile_truth(dense_mask(doc, bl), tile)
    listed, full = _tiles_of(flex_block_mask(doc, bl, tile=tile))
    assert torch.equal(listed, some) and torch.equal(full, every)


@pytest.mark.parametrize("L,tile", [(256, 128), (96, 16), (50, 8)])
def test_document_tiles_are_exactly_the_rule_s_tiles(L, tile):
    """The target's document BlockMask from the documents' boundaries: the same tile lists as
    the dense rule (several documents, one spanning tiles, trailing padding); at 128-tiles and
    a length that is a multiple, also the same as torch's create_block_mask."""
    g = torch.Generator().manual_seed(L)
    doc = torch.full((L,), -1)
    at, d = 0, 0
    while at < L - 5:
        n = int(torch.randint(1, L // 2, (1,), generator=g))
        doc[at:min(at + n, L - 5)] = d
        at, d = at + n, d + 1
    some, every = _tile_truth(document_dense_mask(doc)[0], tile)
    bm = document_block_mask(doc, tile=tile)
    listed, full = _tiles_of(bm)
    assert torch.equal(listed, some) and torch.equal(full, every)
    if L % tile == 0:
        ref = create_block_mask(document_mask_mod(doc), B=None, H=None, Q_LEN=L, KV_LEN=L,
                                device="cpu", BLOCK_SIZE=tile)
        assert [torch.equal(a, b) for a, b in zip(_tiles_of(bm), _tiles_of(ref))] == [True] * 2
