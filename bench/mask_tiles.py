"""How much of the drafter's FlexAttention work is attention (issue #34): the query-key pairs the
objective's mask allows, against the pairs the kernel computes, i.e. every listed tile (partial
and full) times the tile's area, for several tile edges. Deterministic and device-free: the
mask's tiles are the captured step's (``flex_block_mask``), the allowed pairs its dense form.

    python -m bench.mask_tiles --out bench/results/cpu/mask_tiles.json
    python -m bench.mask_tiles --seq 512 --docs 4 --anchors 64 --tiles 32 64 --out /tmp/t.json

Defaults are the quality spec's bucket: 8,192 tokens, 1,536 block slots of 16, 32 documents of
256 tokens (round 14's data: 260 tokens a sample on average, prompt and answer).
"""
from __future__ import annotations

import argparse

import torch

from bench.entry import command_line, run, write_result
from dflash.models.masks import dense_mask, flex_block_mask
from dflash.train.anchors import sample_anchors
from dflash.train.warm import synthetic_row


def add_bucket_args(p: argparse.ArgumentParser) -> None:
    """The drafter's bucket, defaults the quality spec's: ``--seq`` tokens of ``--docs``
    documents with ``--anchors`` block slots of ``--block`` tokens (this and the GPU mask probes)."""
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--docs", type=int, default=32)
    p.add_argument("--anchors", type=int, default=1536)
    p.add_argument("--block", type=int, default=16)


def bucket(a: argparse.Namespace):
    """The bucket's synthetic row and its sampled blocks (seed 0), as ``add_bucket_args`` read."""
    row = synthetic_row(a.seq, 1000, docs=a.docs)
    return row, sample_anchors(row, a.anchors, a.block, torch.Generator().manual_seed(0), 0)


def allowed_pairs(doc_ids: torch.Tensor, blocks) -> int:
    """Query-key pairs the objective's mask allows (its dense form)."""
    return int(dense_mask(doc_ids, blocks).sum())


def computed_pairs(mask) -> int:
    """Query-key pairs a BlockMask makes the kernel compute: every listed tile, partial or
    full, times its area."""
    q_tile, kv_tile = mask.BLOCK_SIZE
    return (int(mask.kv_num_blocks.sum()) + int(mask.full_kv_num_blocks.sum())) * q_tile * kv_tile


def tile_counts(doc_ids: torch.Tensor, blocks, tiles: list[int]) -> dict:
    """Allowed pairs, and for each tile edge the tiles listed and the pairs they compute."""
    allowed = allowed_pairs(doc_ids, blocks)
    out = {"allowed_pairs": allowed, "tiles": {}}
    for t in tiles:
        bm = flex_block_mask(doc_ids, blocks, tile=t)
        partial, full = int(bm.kv_num_blocks.sum()), int(bm.full_kv_num_blocks.sum())
        computed = computed_pairs(bm)
        out["tiles"][str(t)] = {"partial": partial, "full": full, "computed_pairs": computed,
                                "useful_fraction": round(allowed / computed, 4)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bucket_args(p)
    p.add_argument("--tiles", type=int, nargs="+", default=[128, 64, 32])
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    row, blocks = bucket(a)
    doc = {"command": command_line("bench.mask_tiles", argv),
           "torch": torch.__version__, "seq": a.seq, "docs": a.docs, "anchors": a.anchors,
           "block": a.block, "queries": a.anchors * a.block, "keys": a.seq + a.anchors * a.block,
           **tile_counts(row.doc_ids, blocks, a.tiles)}
    print(doc)
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    run(main)
