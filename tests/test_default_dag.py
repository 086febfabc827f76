"""The embedded default spec (specs/tiny.yaml) end to end, as `make run` runs it.

Real target (SmolLM2-135M-Instruct), real prompts, inductor compile, two drafter threads through
the compile gate, speculative decoding on MT-Bench. About 4 minutes on 2 quiet cores; the run
starts in the background with the session (tests/conftest.py) and these tests run last.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.runtime.harness import REPO, copy_workflow, job_counts

pytestmark = pytest.mark.e2e


def _prepare(tmp: Path) -> Path:
    return copy_workflow(tmp, [REPO / "specs" / "tiny.yaml"])


BACKGROUND_DAG = (_prepare, ["bench_tiny"])  # started with the session (tests/conftest.py)


@pytest.fixture(scope="module")
def tiny(background_dag):
    wf, rc, out = background_dag
    assert rc == 0, out[-8000:]
    assert job_counts(out) == {"env": 1, "warmup": 1, "data": 1, "train": 1, "bench": 1}
    return wf


def _json(path):
    return json.loads(path.read_text())


def test_warmup_lists_every_bucket_for_every_drafter_device(tiny):
    warm = _json(tiny / "results" / "tiny" / "warmup" / "manifest.json")
    got = {(c["replica"], c["device"], c["bucket"]) for c in warm["compiled"]}
    assert got == {(r, "cpu", b) for r in (0, 1) for b in (512, 1024)}
    assert warm["fingerprints"]["env"] and warm["fingerprints"]["shape"]
    # the stage's seconds by phase: building the replicas, the target's compile, the drafters'
    phases = warm["seconds_by_phase"]
    assert set(phases) == {"replicas_s", "target_s", "drafters_s"}
    # the phases are contiguous, each rounded to 3 decimals: their sum may pass the rounded
    # total by rounding alone (a fresh clone's run: 35.548 against 35.547)
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= warm["seconds_total"] + 0.002
    drafter_compiles = max(c["seconds"] for c in warm["compiled"] if "replica" in c)
    assert phases["drafters_s"] >= drafter_compiles - 1e-3


def test_training_is_warm_and_race_free(tiny):
    train = _json(tiny / "results" / "tiny" / "train" / "manifest.json")
    assert train["gate"]["recompiles_after_warmup"] == 0
    assert train["gate"]["race_errors"] == 0
    assert train["replicas"] == 2 and train["replicas_identical"] is True
    assert all(e["exactly_once"] for e in train["exactly_once"].values())
    losses = [json.loads(x)["loss"] for x in
              (tiny / "results" / "tiny" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4  # it learns
    acc = [json.loads(x)["draft_acc"] for x in
           (tiny / "results" / "tiny" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(a) == 15 for a in acc)
    assert sum(a[0] for a in acc[-4:]) > sum(a[0] for a in acc[:4])  # position 1 learns


def test_bench_report_has_every_field_and_tau(tiny):
    rep = _json(tiny / "results" / "tiny" / "bench" / "report.json")
    for key in ("tokens_per_s", "samples_per_s", "target_mfu", "drafter_mfu", "peak",
                "target_busy_fraction", "step_time", "time_to_first_step_s",
                "recompiles_after_warmup", "race_errors", "gate_wait_s", "tau", "env",
                "fingerprints"):
        assert rep.get(key) is not None, key
    assert 0.5 < rep["target_busy_fraction"] <= 1.0  # the CPU target is the bottleneck
    assert rep["gate"] == "on" and rep["recompiles_after_warmup"] == 0
    assert set(rep["step_time"]["busy_s_per_step"]) == {"target-0", "drafter-0", "drafter-1"}
    acc = rep["acceptance"]
    assert acc["lossless"] is True          # speculative greedy == target greedy, token for token
    assert acc["tau"] == acc["sets"]["mtbench"]["tau"] and len(acc["accept_rate_by_position"]) == 15
    assert set(acc["sets"]) == {"mtbench", "humaneval", "heldout"}
    for name, s in acc["sets"].items():      # τ is tokens over verification forwards, in [1, B]
        assert s["prompts"] == 6 and s["tau"] == s["tokens"] / s["forwards"], name
        assert 1.0 <= s["tau"] <= 16.0 and sum(s["tokens_per_forward_histogram"]) == \
            s["forwards"], name
    real = acc["sets"]["mtbench"]["real"]
    assert real["lossless"] is True and real["tokens_equal_simulated"] == 2
    # CPU float32: real decoding (no chain walk) ran exactly the simulated blocks
    assert real["blocks_equal_simulated"] == 2
    assert real["tau"] == real["tau_simulated_same_prompts"]
    assert rep["env_drift_overridden"] == [] and rep["mfu_datasheet"] is None  # CPU: no datasheet
    for png in ("loss.png", "throughput.png", "acceptance.png", "tau_by_category.png"):
        assert (tiny / "results" / "tiny" / "bench" / png).stat().st_size > 1000
    cfg = _json(tiny / "results" / "tiny" / "train" / "drafter" / "config.json")
    assert cfg["dflash_config"]["mask_token_id"] == 4 and cfg["block_size"] == 16


def test_audit_passes_right_after_the_run(tiny):
    r = subprocess.run([sys.executable, "-m", "dflash", "audit",
                        "results/tiny/env/manifest.json"], cwd=tiny, capture_output=True,
                       text=True, env={**__import__("os").environ, "PYTHONPATH": str(tiny)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no drift" in r.stdout.lower()
