"""bench/mask_tiles.py: the drafter mask's listed tiles cover every allowed pair, and smaller tiles
waste less of the kernel's work (the figures of bench/results/cpu/mask_tiles.json)."""
import json
from pathlib import Path

import torch

from bench import mask_tiles
from dflash.models.masks import dense_mask
from dflash.train.anchors import sample_anchors
from dflash.train.warm import synthetic_row

REPO = Path(__file__).resolve().parents[1]


def test_tiles_cover_the_allowed_pairs_and_smaller_tiles_waste_less(tmp_path):
    row = synthetic_row(512, 100, docs=4)
    blocks = sample_anchors(row, 64, 16, torch.Generator().manual_seed(0), 0)
    got = mask_tiles.tile_counts(row.doc_ids, blocks, [128, 64, 32, 16])
    assert got["allowed_pairs"] == int(dense_mask(row.doc_ids, blocks).sum()) > 0
    fractions = [got["tiles"][t]["useful_fraction"] for t in ("128", "64", "32", "16")]
    assert all(0 < f <= 1 for f in fractions) and fractions == sorted(fractions)
    out = tmp_path / "t.json"
    assert mask_tiles.main(["--seq", "512", "--docs", "4", "--anchors", "64", "--tiles", "64",
                            "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["queries"] == 1024 and doc["keys"] == 1536 and set(doc["tiles"]) == {"64"}


def test_the_committed_figures_are_the_quality_buckets():
    doc = json.loads((REPO / "bench/results/cpu/mask_tiles.json").read_text())
    assert (doc["seq"], doc["anchors"], doc["block"]) == (8192, 1536, 16)
    t = doc["tiles"]["128"]
    assert t["computed_pairs"] == (t["partial"] + t["full"]) * 128 * 128 > doc["allowed_pairs"]
