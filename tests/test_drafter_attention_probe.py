"""bench/gpu/drafter_attention.py on CPU (eager flex, forward only): every tiling computes the
same attention, the computed pairs are the listed tiles' area (bench/mask_tiles.py's count), and
the dense variant counts every pair."""
import json

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config
from torch._inductor.virtualized import V

from bench import mask_tiles
from bench.gpu import drafter_attention
from dflash.train.anchors import sample_anchors
from dflash.train.warm import synthetic_row


def test_tilings_agree_and_count_the_tiles_they_compute(tmp_path):
    out = tmp_path / "att.json"
    args = ["--device", "cpu", "--eager", "--no-backward", "--seq", "256", "--docs", "4",
            "--anchors", "32", "--iters", "1", "--variants", "tile128", "tile32", "dense",
            "--out", str(out)]
    assert drafter_attention.main(args) == 0
    doc = json.loads(out.read_text())
    v = doc["variants"]
    assert set(v) == {"tile128", "tile32", "dense"} and not any("error" in r for r in v.values())
    row = synthetic_row(256, 1000, docs=4)
    blocks = sample_anchors(row, 32, 16, torch.Generator().manual_seed(0), 0)
    tiles = mask_tiles.tile_counts(row.doc_ids, blocks, [128, 32])
    assert doc["allowed_pairs"] == tiles["allowed_pairs"] > 0
    for t in ("128", "32"):
        assert v[f"tile{t}"]["computed_pairs"] == tiles["tiles"][t]["computed_pairs"]
    assert v["tile32"]["allowed_over_computed"] > v["tile128"]["allowed_over_computed"]
    assert v["tile32"]["max_abs_diff_vs_first"] < 1e-2  # same rule, other tiles
    assert v["dense"]["computed_pairs"] == doc["queries"] * doc["keys"] == 512 * 768
    assert v["dense"]["allowed_over_computed"] == 1.0 and v["tile128"]["forward_ms"] > 0


def test_small_tiles_set_the_kernels_blocks_to_the_tile():
    assert drafter_attention.kernel_options(128) is None
    assert set(drafter_attention.kernel_options(64).values()) == {64}


def test_the_small_tile_backward_offers_a_configuration_that_fits_the_tile():
    """The filter inductor applies (kernel/flex/flex_attention.py) keeps it, and it meets the
    kernel's own constraints (BLOCK_N1 % BLOCK_M1, BLOCK_M2 % BLOCK_N2)."""
    for tile in (64, 32):
        confs = drafter_attention.small_tile_choices(tile).get_flex_attention_bwd_configs(
            64, torch.bfloat16, "cuda")
        assert confs
        for c in confs:
            assert all(tile % b == 0 for b in (c.block_m1, c.block_n1, c.block_m2, c.block_n2))
            assert c.block_n1 % c.block_m1 == 0 and c.block_m2 % c.block_n2 == 0


def test_the_small_tile_backward_reaches_the_backwards_compile(monkeypatch):
    """Round 17's probe set the choices on the calling thread only, while autograd compiled the
    backward lazily on its device thread: installed, the backward compiles with the forward on
    the calling thread, where the variant's choices offer its tile (and inductor's own at 128),
    and a thread that never saw them makes its choices from the same factory where the config
    is shared."""
    monkeypatch.setattr(functorch_config, "force_non_lazy_backward_lowering", False)
    monkeypatch.setattr(config, "inductor_choices_class", None)
    assert drafter_attention.install_small_tile_choices() == [
        "functorch.config.force_non_lazy_backward_lowering",
        "inductor.config.inductor_choices_class"]
    assert functorch_config.force_non_lazy_backward_lowering is True
    with drafter_attention.choices_for("tile64"):
        assert V.choices.uuid().endswith("/64")
        confs = V.choices.get_flex_attention_bwd_configs(64, torch.bfloat16, "cuda")
        assert [(c.block_m1, c.block_n1, c.block_m2, c.block_n2) for c in confs] == [(64,) * 4]
    assert drafter_attention._TILE == [128] and type(V.choices).__name__ != "SmallTileChoices"
    made = config.inductor_choices_class()  # what a thread without a handler makes its own from
    with drafter_attention.choices_for("tile32"):
        assert made.uuid().endswith("/32")
