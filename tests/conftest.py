"""Shared fixtures. The workflow-copy machinery is dflash.runtime.harness (benchmarks use it too).

Background DAG runs: a test module that sets ``BACKGROUND_DAG = (prepare, targets)`` gets its
Snakemake run started with the session (``prepare(tmp)`` makes the workflow copy and returns it;
``snakemake --cores 2 *targets`` runs there) in one niced background lane, the runs one after
another in the order the modules come; the module's fixtures take it through
:func:`background_dag`. Most of the suite keeps one of the two cores busy; the lane fills the
other, so the suite takes less than the sum of its parts. The default DAG's tests (the longest
run) go last, to give it the whole suite.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash.runtime import faults as fi
from dflash.runtime.harness import REPO, workflow_env

LAST_MODULE = "test_default_dag.py"
_SUMMARY: list[str] = []


def pytest_collection_modifyitems(items):
    """The default DAG's tests last (a stable sort: every other test keeps its order)."""
    items.sort(key=lambda item: item.path.name == LAST_MODULE)


class Lane:
    """Snakemake runs one after another in a background thread, niced (the tests in the
    foreground keep their speed: some time their own processes); each ends in its own
    ``<workflow>/snakemake.log``."""

    def __init__(self, jobs: list[tuple[str, Path, list[str]]]):
        self.jobs = jobs
        self.done = {name: threading.Event() for name, _, _ in jobs}
        self.result: dict[str, tuple[int, float]] = {}
        self.run: fi.Run | None = None
        self.stopped = False
        self.lock = threading.Lock()  # stop() and the start of the next run exclude each other
        threading.Thread(target=self._work, name="background-dags", daemon=True).start()

    def _work(self) -> None:
        for name, wf, targets in self.jobs:
            t0 = time.time()
            cmd = ["nice", "-n", "10", sys.executable, "-m", "snakemake", "--cores", "2", *targets]
            with self.lock:
                if not self.stopped:
                    with open(wf / "snakemake.log", "w") as fh:
                        proc = subprocess.Popen(cmd, cwd=wf, env=workflow_env(wf), stdout=fh,
                                                stderr=subprocess.STDOUT, start_new_session=True)
                    self.run = fi.Run(proc, t0, wf / "snakemake.log", cmd)
            rc = self.run.proc.wait() if not self.stopped else -9
            self.result[name] = (rc, time.time() - t0)
            self.done[name].set()

    def wait(self, name: str, timeout: float) -> tuple[int, float]:
        if not self.done[name].wait(timeout):
            raise TimeoutError(f"background run of {name} not done within {timeout:.0f} s")
        return self.result[name]

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            if self.run is not None and self.run.alive():
                self.run.kill()


@pytest.fixture(scope="session", autouse=True)
def background_lane(request, tmp_path_factory):
    """The lane of every selected module's BACKGROUND_DAG (None when there is none), stopped at
    the end of the session; the summary after the durations gives each run's wall time."""
    jobs, seen = [], set()
    for item in request.session.items:
        spec = getattr(getattr(item, "module", None), "BACKGROUND_DAG", None)
        # only for a selected test that takes the run (fixturenames: the whole closure)
        if spec is not None and "background_dag" in getattr(item, "fixturenames", ()) \
                and item.module.__name__ not in seen:
            seen.add(item.module.__name__)
            prepare, targets = spec
            name = item.module.__name__
            jobs.append((name, prepare(tmp_path_factory.mktemp(name.rsplit(".", 1)[-1])),
                         list(targets)))
    lane = Lane(jobs) if jobs else None
    yield lane
    if lane is not None:
        lane.stop()
        for name, wf, targets in jobs:
            if name in lane.result:
                rc, seconds = lane.result[name]
                _SUMMARY.append(f"background `snakemake {' '.join(targets)}` ({name}): "
                                f"{seconds:.0f} s wall beside the suite, exit {rc} "
                                f"(per stage: {wf}/benchmarks/)")


@pytest.fixture(scope="module")
def background_dag(request, background_lane) -> tuple[Path, int, str]:
    """This module's background run, waited for: (workflow copy, exit status, its output)."""
    name = request.module.__name__
    wf = next(w for n, w, _ in background_lane.jobs if n == name)
    rc, _ = background_lane.wait(name, timeout=1800)
    return wf, rc, (wf / "snakemake.log").read_text()


def pytest_terminal_summary(terminalreporter):
    for line in _SUMMARY:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def micro_spec() -> Path:
    return REPO / "tests" / "specs" / "micro.yaml"


@pytest.fixture(scope="session", autouse=True)
def torch_one_thread_session():
    """One intra-op thread for the whole session, as the stages the tests start already run
    (Snakemake's jobs, harness.stage_env: in-process and stage sums then agree). On 2 cores the
    foreground shares the CPU with the niced background lane (and, on a shared box, with others):
    a 2-thread OpenMP region waits at each barrier for the thread that lost its core. Measured on
    the 2-core box: test_generate beside two niced 1-thread torch loops 73 s with 2 threads, 56 s
    with 1; without them 58 s either way (a 2-thread matmul loop: 0.34 s idle, 11.5 s once, on a
    loaded box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test (tiny tensors; robust to a busy machine). The session
    runs with one already (torch_one_thread_session); this keeps a module that asks for it
    right when run under another set-up."""
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
