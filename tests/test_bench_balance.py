"""The bench report's worker balance (per-GPU rates, drafter idle share, recommended anchors,
projections) from a real H200 run's committed manifest and metrics, and its hardware section."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dflash.env.facts import hardware_facts
from dflash.eval.report import render_report_md
from dflash.models.drafter import DFlashConfig
from dflash.spec.load import load_spec
from dflash.train.flops import (datasheet_peak, drafter_cost, mfu_against_datasheet, project_tokens_per_s,
                               target_side, worker_balance)

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "bench" / "results" / "h200" / "qwen3-8b-2gpu"


@pytest.fixture(scope="module")
def h200_run():
    """specs/qwen3-8b-2gpu.yaml's H200 run (1 target + 1 drafter, 512 anchors): the train
    manifest's busy/wait totals and the steady-state window of its metrics."""
    spec = load_spec(REPO / "specs" / "qwen3-8b-2gpu.yaml")
    train = json.loads((H200 / "qwen3-8b-2gpu__train__manifest.json").read_text())
    metrics = [json.loads(x) for x in
               (H200 / "qwen3-8b-2gpu__train__metrics.jsonl").read_text().splitlines()]
    window = metrics[len(metrics) - train["steady_state"]["steps"]:]
    bal = worker_balance(spec, DFlashConfig.of_spec(spec), window, train["busy_s"], train["wait_s"],
                         train["steps"]["run_now"])
    return spec, train, window, bal


def test_rates_idle_and_recommended_anchors(h200_run):
    spec, train, window, bal = h200_run
    tokens = sum(m["tokens"] for m in window) / len(window)
    n = train["steps"]["run_now"]
    # one target, one drafter: each does a step's tokens in its busy seconds per step
    assert bal["target_tokens_per_s_per_gpu"] == pytest.approx(
        tokens / (train["busy_s"]["target-0"] / n))
    assert 29_000 < bal["target_tokens_per_s_per_gpu"] < 31_000
    assert 65_000 < bal["drafter_tokens_per_s_per_gpu"] < 75_000
    assert bal["drafter_idle_fraction"] == pytest.approx(0.568, abs=0.01)  # the 57 %
    a = bal["anchors"]
    assert a["max_anchors"] == 512 and 490 < a["used_per_row"] <= 512
    # the drafter is busy 0.43 × the target: ~2.1× the anchors fill 90 % of the target's step
    assert 1024 <= a["recommended_max_anchors"] <= 1280 and a["recommended_max_anchors"] % 64 == 0
    busy_then = bal["drafter_busy_s_per_step"] * (
        drafter_cost(DFlashConfig.of_spec(spec), tokens, a["recommended_max_anchors"], 16)
        / drafter_cost(DFlashConfig.of_spec(spec), tokens, 512, 16))
    assert 0.8 * bal["target_busy_s_per_step"] < busy_then <= 0.9 * bal["target_busy_s_per_step"]
    assert a["drafter_tokens_per_s_per_gpu_at_recommended"] < bal["drafter_tokens_per_s_per_gpu"]


def test_projection_is_the_slower_side(h200_run):
    _, _, _, bal = h200_run
    t, d = bal["target_tokens_per_s_per_gpu"], bal["drafter_tokens_per_s_per_gpu"]
    assert project_tokens_per_s(t, d, 1, 1) == t                 # target-bound here
    assert project_tokens_per_s(t, d, 7, 1) == d                 # one drafter cannot keep up
    splits = {(p["targets"], p["drafters"]): p for p in bal["projection"]["splits"]}
    assert set(splits) == {(1, 1)} | {(k, 8 - k) for k in range(1, 8)}
    assert splits[(5, 3)]["tokens_per_s"] == pytest.approx(min(5 * t, 3 * d))
    # more anchors cost drafter capacity: the projection at them never exceeds today's
    assert all(p["tokens_per_s_at_recommended_anchors"] <= p["tokens_per_s"] + 1e-6
               for p in splits.values())


def test_no_busy_times_is_skipped_not_an_error(h200_run):
    spec, _, window, _ = h200_run
    assert "skipped" in worker_balance(spec, DFlashConfig.of_spec(spec), window, {}, {}, 60)
    assert "skipped" in worker_balance(spec, DFlashConfig.of_spec(spec), [], {"target-0": 1.0,
                                                                        "drafter-0": 1.0}, {}, 60)


def test_hardware_facts_cpu_and_cuda_structure():
    cpu = hardware_facts(["cpu", "cpu"], {})
    assert cpu["accelerator"] == "cpu" and cpu["gpu_count"] == 0 and cpu["driver"] is None
    assert "CPU run" in cpu["note"]
    # CUDA devices named on a machine without them: one entry each, the failure recorded, the
    # driver taken from the env stage's record of the machine
    hw = hardware_facts(["cuda:1", "cuda:0", "cuda:1"], {"nvidia": {"driver": "580.159.04",
                                                                     "gpus": ["NVIDIA H200"]}})
    assert hw["accelerator"] == "cuda" and hw["gpu_count"] == 2
    assert [g["device"] for g in hw["gpus"]] == ["cuda:0", "cuda:1"]
    assert hw["driver"] == "580.159.04" and hw["driver_source"] == "env manifest"

    if not torch.cuda.is_available():
        assert all(g["name"] is None and g["error"] for g in hw["gpus"])


def test_report_md_shows_balance_and_hardware(h200_run):
    _, _, _, bal = h200_run
    report = json.loads((H200 / "qwen3-8b-2gpu__bench__report.json").read_text())
    report.update(balance=bal, drafter_mfu_while_busy=0.5, final_draft_acc=None,
                  hardware={"accelerator": "cuda", "gpu_count": 2, "visible_gpus": 2,
                            "gpus": [{"device": "cuda:0", "name": "NVIDIA H200"},
                                     {"device": "cuda:1", "name": "NVIDIA H200"}],
                            "models": ["NVIDIA H200"], "driver": "580.159.04",
                            "driver_source": "env manifest"})
    md = render_report_md(report)
    assert "cuda:0 NVIDIA H200, cuda:1 NVIDIA H200" in md and "580.159.04" in md
    assert f"| {bal['anchors']['recommended_max_anchors']} (drafter capacity" in md
    assert "| 5 + 3 |" in md
    report["hardware"] = hardware_facts(["cpu"], {})
    report["balance"] = {"skipped": "no steady-state steps or no busy times recorded"}
    md = render_report_md(report)
    assert "CPU run: no GPU in the topology" in md and "Skipped: no steady-state" in md


def test_report_md_shows_both_mfu_denominators_and_overridden_drift():
    """The committed H200 report rendered with today's fields: each MFU over the measured peak
    and over the datasheet peak, and the drift a DFLASH_ALLOW_DRIFT=1 run went on with."""
    report = json.loads((H200 / "qwen3-8b-2gpu__bench__report.json").read_text())
    report["peak"]["datasheet"] = datasheet_peak("NVIDIA H200", "bfloat16")
    report.update(drafter_mfu_while_busy=0.44, final_draft_acc=None,
                  balance={"skipped": "x"}, hardware=hardware_facts(["cpu"], {}),
                  mfu_datasheet=mfu_against_datasheet(report["peak"], target_mfu=0.5,
                                                      drafter_mfu=0.25,
                                                      drafter_mfu_while_busy=0.44),
                  env_drift_overridden=[{"kind": "package", "name": "pyyaml",
                                         "pinned": "0.0.1", "found": "6.0.2"}])
    md = render_report_md(report)
    scale = report["peak"]["flops_per_s"] / 989e12
    assert "| target MFU (over the measured peak) | 0.502 |" in md
    assert "8192³ bfloat16 matmul on cuda:1) | 788,720,354,946,260 |" in md
    assert ("over the datasheet peak (989,000,000,000,000 FLOP/s: NVIDIA H200 SXM datasheet"
            in md)
    assert f"| {0.5 * scale:.3g} / {0.25 * scale:.3g} ({0.44 * scale:.3g}) |" in md
    assert "environment drift overridden (`DFLASH_ALLOW_DRIFT=1`)**: pyyaml pinned 0.0.1, " \
           "found 6.0.2" in md
    report.update(mfu_datasheet=None, env_drift_overridden=[])
    md = render_report_md(report)
    assert "| MFU over a datasheet peak | n/a (no datasheet entry" in md
    assert "environment drift: none" in md


# the DAG run of smollm2-quality on one H200 (db536a8): 59.8 ms steps of ~8,186 target
# tokens (136,883 tok/s), the drafter busy 57.6 ms, the target busy 17 % (10.2 ms)
Q_TOKENS, Q_TARGET, Q_DRAFTER = 8186.0, 0.0102, 0.0576


def _quality_before_cache():
    """smollm2-quality as the issue's run had it: the feature cache off, 3 epochs (6 since
    round 16)."""
    spec = load_spec(REPO / "specs" / "smollm2-quality.yaml")
    return replace(spec, features=replace(spec.features, cache="off"),
                   optim=replace(spec.optim, epochs=3))


def test_target_side_on_a_shared_gpu_recommends_the_feature_cache_with_figures():
    spec = _quality_before_cache()
    ts = target_side(spec, Q_TARGET, Q_DRAFTER, Q_TOKENS)
    assert ts["shared_gpu"] and ts["epochs"] == 3 and not ts["features_cache"]
    now, _, three = ts["what_if"]
    assert now["bound"] == "drafter" and three["drafter_speedup"] == 3.0
    # shared GPU: the busy times add up (10.2 + 57.6 ms now, 10.2 + 19.2 ms at 3x)
    assert now["tokens_per_s"] == pytest.approx(Q_TOKENS / 0.0678)
    assert three["tokens_per_s"] == pytest.approx(278_435, rel=1e-3)
    assert three["target_share_of_device"] == pytest.approx(0.0102 / 0.0294)
    # epochs 1 and 2 read the cache: the drafter alone; the 3-epoch run averages the two
    assert three["tokens_per_s_epochs_ge_1_with_cache"] == pytest.approx(Q_TOKENS / 0.0192)
    assert three["tokens_per_s_whole_run_with_cache"] == pytest.approx(
        3 / (1 / three["tokens_per_s"] + 2 / three["tokens_per_s_epochs_ge_1_with_cache"]))
    assert [r["field"] for r in ts["recommend"]] == ["features.cache"]
    assert "278,435 -> 426,354 tok/s" in ts["recommend"][0]["why"]
    # with the cache on and one epoch, a target that outlasts the 3x drafter wants its own GPU
    one = replace(spec, optim=replace(spec.optim, epochs=1),
                  features=replace(spec.features, cache="host"))
    ts = target_side(one, 0.025, Q_DRAFTER, Q_TOKENS)
    assert ts["what_if"][-1]["bound"] == "target" and ts["bound_now"] == "drafter"
    assert [r["field"] for r in ts["recommend"]] == ["topology.targets"]
    assert ts["what_if"][-1]["tokens_per_s_whole_run_with_cache"] is None


def test_target_side_on_separate_gpus(h200_run):
    spec, _, window, bal = h200_run  # qwen3-8b-2gpu: target-bound today, a step budget
    ts = bal["target_side"]
    assert not ts["shared_gpu"] and ts["bound_now"] == "target"
    t, d = bal["target_busy_s_per_step"], bal["drafter_busy_s_per_step"]
    tokens = sum(m["tokens"] for m in window) / len(window)
    assert ts["what_if"][0]["tokens_per_s"] == pytest.approx(tokens / max(t, d))
    fields = [r["field"] for r in ts["recommend"]]
    assert "batching.max_anchors" in fields and "topology.targets" not in fields
    # a drafter-bound split with the drafter fast enough: nothing to change
    assert target_side(spec, 0.001, 0.01, 1000.0)["recommend"] == []


def test_report_md_shows_the_target_side(h200_run):
    report = json.loads((H200 / "qwen3-8b-2gpu__bench__report.json").read_text())
    spec = _quality_before_cache()
    bal = dict(h200_run[3], target_side=target_side(spec, Q_TARGET, Q_DRAFTER, Q_TOKENS))
    report.update(balance=bal, drafter_mfu_while_busy=None, final_draft_acc=None,
                  hardware=hardware_facts(["cpu"], {}))
    md = render_report_md(report)
    assert "share a GPU: their busy times add up" in md
    assert "| 3× faster | drafter | 0.347 | 278,435 | 426,354 |" in md
    assert "recommend `features.cache`: host (the target takes 15% of the shared GPU" in md
