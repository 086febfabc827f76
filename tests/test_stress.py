"""`python -m dflash.runtime.stress` in a SUBPROCESS (a poisoned process must not poison pytest), both ways:
without the gate the FX-nested-trace race must reproduce (so this test can fail), with it: zero errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stress(*args: str, timeout: float = 120) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "dflash.runtime.stress", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, p.stdout[-2000:]
    res = json.loads(lines[0])
    assert "harness_error" not in res, res
    return res


def test_gate_off_reproduces_fx_race():
    r = _stress("--gate", "off", "--scenario", "adv_fx", "--threads", "2", "--iterations", "60",
                "--shapes", "2x32,2x64", "--max-seconds", "60")
    assert r["gate"] == "off"
    assert r["errors_total"] > 0, r  # the race reproduces without the gate
    assert r["errors"].get("FX_NESTED_TRACE", 0) > 0, r["errors"]
    assert r["adversary_ops"]["fx"] > 0


def test_gate_on_zero_errors_over_many_iterations():
    r = _stress("--gate", "on", "--scenario", "mixed", "--threads", "3", "--iterations", "150",
                "--shapes", "2x32,2x64,4x32", "--max-seconds", "80")
    assert r["gate"] == "on"
    assert not r["timed_out"] and r["barrier_broken"] == 0
    assert r["errors_total"] == 0, r["errors"]
    assert r["adversary_errors"] == {}, r["adversary_errors"]
    assert r["fallbacks"] == 0
    assert r["flag_stuck_after"] is False and r["poisoned"] is False
    assert r["race_errors"]["count"] == 0
    assert r["steady_iterations"] == 3 * 150 and r["ok_iterations"] == r["iterations_done"]
    assert r["compiles"] == 3 * 3 and r["recompiles"] == 0
    assert all(v > 0 for v in r["adversary_ops"].values()), r["adversary_ops"]  # adversaries really ran
    assert r["post_probe"] == "compiled"
