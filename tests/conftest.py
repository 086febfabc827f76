"""Shared fixtures. The workflow-copy machinery is dflash.runtime.harness (benchmarks use it too).

The default DAG (specs/tiny.yaml, minutes) runs in the background from the session's first test
(:func:`background_tiny`) and its tests run last: most of the suite keeps one of the two cores
busy, and that run fills the other, so the suite takes less than the sum of its parts.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash.runtime import faults as fi
from dflash.runtime.harness import REPO, copy_workflow, workflow_env

BACKGROUND_MODULE = "test_default_dag.py"
_SUMMARY: list[str] = []


def pytest_collection_modifyitems(items):
    """The background run's tests last (a stable sort: every other test keeps its order)."""
    items.sort(key=lambda item: item.path.name == BACKGROUND_MODULE)


@pytest.fixture(scope="session", autouse=True)
def background_tiny(request, tmp_path_factory):
    """``snakemake bench_tiny`` in a workflow copy, started with the session when the default
    DAG's tests are selected (None otherwise), as :func:`dflash.runtime.harness.snakemake` runs
    it but niced: the tests in the foreground keep their speed (some time their processes), and
    this run takes the core they leave idle. Killed at the end of the session if still running."""
    if not any(item.path.name == BACKGROUND_MODULE for item in request.session.items):
        yield None
        return
    wf = copy_workflow(tmp_path_factory.mktemp("tiny"), [REPO / "specs" / "tiny.yaml"])
    log = wf / "snakemake.log"
    cmd = ["nice", "-n", "10", sys.executable, "-m", "snakemake", "--cores", "2", "bench_tiny"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=wf, env=workflow_env(wf), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    run = fi.Run(proc, time.time(), log, cmd)
    yield run
    if run.alive():
        run.kill()
    else:  # the log's last write is the run's end: its wall time, shown after the durations
        _SUMMARY.append(f"background `snakemake bench_tiny` (tests/{BACKGROUND_MODULE}): "
                        f"{log.stat().st_mtime - run.t0:.0f} s wall, overlapped with the suite "
                        f"(per stage: {wf}/benchmarks/tiny/*.tsv)")


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def micro_spec() -> Path:
    return REPO / "tests" / "specs" / "micro.yaml"


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test (tiny tensors; robust to a busy machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


EPS32 = torch.finfo(torch.float32).eps


def f32_close(got: torch.Tensor, want: torch.Tensor, depth: int) -> bool:
    """Equal up to float32 accumulation order: a sum of ``depth`` terms taken in another order
    (another CPU's kernels, blocking or vector width) differs by at most depth·eps relative to
    its summed magnitude (Higham's γ_n bound), taken norm-wise over the tensor."""
    return float((got - want).norm()) <= depth * EPS32 * float(want.norm())


def assert_f32_close(got: torch.Tensor, want: torch.Tensor, depth: int) -> None:
    """:func:`f32_close` as an assertion that reports the relative error against the bound."""
    err = float((got - want).norm()) / max(float(want.norm()), 1e-30)
    assert f32_close(got, want, depth), f"relative error {err:.3g} > {depth} * eps"
