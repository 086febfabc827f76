"""The MFU numerator and its two denominators: the drafter's FLOPs counted as computed (the
frozen lm_head without a weight gradient), one counting rule for the bench stage and the bench
scripts, the datasheet peak beside the measured one, and the committed recount."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import mfu_denominators
from bench.gpu import drafter_step
from dflash.models.drafter import DFlashConfig
from dflash.spec.load import load_spec
from dflash.train.flops import datasheet_peak, drafter_flops_per_step, drafter_useful_flops, mfu_against_datasheet

REPO = Path(__file__).resolve().parents[1]


def test_drafter_flops_by_hand():
    """One layer, hidden 8, MLP 16, 2 heads of 4 (1 KV head), 3 target features, vocab 100."""
    cfg = SimpleNamespace(hidden_size=8, intermediate_size=16, head_dim=4,
                          num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                          target_layer_ids=[0, 1, 2], vocab_size=100)
    layer = 8 * 4 * (2 * 2 + 1 * 2) + 3 * 8 * 16            # q, o + k, v; gate, up, down
    ctx, block, lab = 10, 6, 5
    trained = 2 * layer * block + 2 * ctx * 8 * 4 * 1 * 2 + 2 * ctx * 3 * 8 * 8
    lm_head = 2 * lab * 8 * 100
    # trained weights: forward + input grad + weight grad; frozen lm_head: forward + input grad
    assert drafter_flops_per_step(cfg, ctx, block, lab) == 3 * trained + 2 * lm_head
    assert drafter_useful_flops(cfg, ctx, lab) == drafter_flops_per_step(cfg, ctx, lab, lab)


def test_datasheet_peak_and_mfu_over_it():
    h200 = datasheet_peak("NVIDIA H200", "bfloat16")
    assert h200["flops_per_s"] == 989e12 and "datasheet" in h200["source"]
    assert datasheet_peak("NVIDIA H200", "float32") is None and datasheet_peak(None, "bfloat16") \
        is None
    peak = {"flops_per_s": 791.2e12, "datasheet": h200}
    got = mfu_against_datasheet(peak, target_mfu=0.5, drafter_mfu=None)
    assert got["target_mfu"] == pytest.approx(0.4) and got["drafter_mfu"] is None
    assert mfu_against_datasheet({"flops_per_s": 1e11, "datasheet": None}, target_mfu=0.5) is None


def test_drafter_step_script_counts_like_the_bench_stage():
    """bench/gpu/drafter_step.py's MFU numerator is the bench stage's: the training step's own
    token and labelled counts (metrics "tokens" / "labelled") through drafter_useful_flops."""
    ds = drafter_step
    spec = load_spec(REPO / "tests" / "specs" / "micro.yaml").replace(
        compile={"backend": "eager"})
    r = ds.measure(spec, 16, "cpu", 1, None)
    cfg = DFlashConfig.of_spec(spec)
    assert r["num_slots"] == 16 and r["labelled"] <= 16 * (cfg.block_size - 1)
    assert r["tokens"] == r["bucket"] == 256                 # a full synthetic row
    assert r["flops_per_step"] == drafter_useful_flops(cfg, r["tokens"], r["labelled"])
    # all slots' block tokens would count more: the padded/anchor positions are not useful
    assert r["flops_per_step"] < drafter_flops_per_step(cfg, r["tokens"],
                                                        16 * cfg.block_size, r["labelled"])


def test_committed_mfu_recount_matches_the_committed_runs():
    """bench/results/h200/mfu_denominators.json is what the script computes from the committed
    reports and metrics today; the drafter MFU falls by the lm_head's extra forward."""
    md = mfu_denominators
    committed = json.loads((REPO / "bench/results/h200/mfu_denominators.json").read_text())
    run = committed["runs"]["qwen3-8b-2gpu-balanced"]
    report = json.loads((REPO / run["report"]).read_text())
    assert run["target_mfu"]["committed_over_measured_peak"] == report["target_mfu"]
    assert run["drafter_mfu"]["committed_over_measured_peak"] == report["drafter_mfu"]
    h = md.H200
    rep, warm, train, metrics = md.RUNS["qwen3-8b-2gpu-balanced"]

    dcfg = DFlashConfig(**json.loads((h / warm).read_text())["drafter_config"])
    steps = json.loads((h / train).read_text())["steady_state"]["steps"]
    rows = [json.loads(x) for x in (h / metrics).read_text().splitlines() if x.strip()]
    again = md.recount(report, dcfg, rows[len(rows) - steps:], "NVIDIA H200")
    assert again == {k: v for k, v in run.items() if k != "report"}
    d = run["drafter_mfu"]
    assert d["over_measured_peak"] == pytest.approx(d["committed_over_measured_peak"]
                                                    * run["drafter_flops_recounted_over_committed"])
    assert 0.85 < run["drafter_flops_recounted_over_committed"] < 0.9
    assert d["over_datasheet_peak"] == pytest.approx(d["over_measured_peak"] * 781.68 / 989,
                                                     rel=1e-4)
