"""Shared fixtures. The workflow-copy machinery is dflash.runtime.harness (benchmarks use it too).

Background runs: a test module that sets ``BACKGROUND_DAG = (prepare, targets)`` gets its
Snakemake run started with the session (``prepare(tmp)`` makes the workflow copy and returns it;
``snakemake --cores 2 *targets`` runs there); one that sets ``BACKGROUND_CMD = (prepare, args)``
gets ``python *args`` run from the repo, ``{folder}`` in an argument standing for the folder
``prepare(tmp)`` returns (where its output goes). Both go in one niced background lane, the
runs one after another in the order their modules come; the module's fixtures take a run
through :func:`background_dag` or :func:`background_cmd`. Most of the suite keeps one of the
two cores busy; the lane fills the other, so the suite takes less than the sum of its parts.
The modules with a background run come after every other module, in the lane's order (the lane
has done their runs by then, so the foreground never waits for one), and the default DAG's
tests (the longest run) last. On the 2-core box of 2026-12-06 the suite took 1,041-1,084 s
before the two commands moved here and 885-963 s after (bench/results/cpu/suite_lane_2026-12-06/,
bench/results/cpu/fresh_clone_suite_2026-12-06.md); 902 s, then 831 s once test_resume's reference
run and test_self_written's mix joined the lane (d633883).
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from dflash.runtime import faults as fi
from dflash.runtime.harness import REPO, workflow_env

LAST_MODULE = "test_default_dag.py"
_SUMMARY: list[str] = []


BACKGROUND = {"BACKGROUND_DAG": "background_dag", "BACKGROUND_CMD": "background_cmd"}


def _background(item) -> tuple[str, tuple] | None:
    """(fixture name, the module's BACKGROUND_* value) where a selected test takes its
    module's background run (fixturenames: the whole closure), else None."""
    module = getattr(item, "module", None)
    for attr, fixture in BACKGROUND.items():
        spec = getattr(module, attr, None)
        if spec is not None and fixture in getattr(item, "fixturenames", ()):
            return fixture, spec
    return None


def pytest_collection_modifyitems(items):
    """The modules with a background run after the rest, the default DAG's tests last (a stable
    sort: the tests keep their order otherwise)."""
    late = {item.module.__name__ for item in items if _background(item)}
    items.sort(key=lambda item: (item.path.name == LAST_MODULE,
                                 getattr(item, "module", None) is not None
                                 and item.module.__name__ in late))


@dataclass
class Job:
    """One background run: its command, where it runs and with what environment, its log."""
    name: str
    folder: Path  # the workflow copy (a DAG) or the folder the command writes into
    cmd: list[str]
    cwd: Path
    env: dict
    log: Path


def _job(name: str, fixture: str, spec: tuple, tmp: Path) -> Job:
    prepare, args = spec
    folder = prepare(tmp)
    if fixture == "background_dag":
        return Job(name, folder, [sys.executable, "-m", "snakemake", "--cores", "2", *args],
                   folder, workflow_env(folder), folder / "snakemake.log")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return Job(name, folder, [sys.executable, *(a.format(folder=folder) for a in args)], REPO,
               env, folder / "background.log")


class Lane:
    """Background runs one after another in a thread, niced (the tests in the foreground keep
    their speed: some time their own processes); each ends in its own log."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.done = {job.name: threading.Event() for job in jobs}
        self.result: dict[str, tuple[int, float]] = {}
        self.run: fi.Run | None = None
        self.stopped = False
        self.lock = threading.Lock()  # stop() and the start of the next run exclude each other
        threading.Thread(target=self._work, name="background-runs", daemon=True).start()

    def _work(self) -> None:
        for job in self.jobs:
            t0 = time.time()
            cmd = ["nice", "-n", "10", *job.cmd]
            with self.lock:
                if not self.stopped:
                    with open(job.log, "w") as fh:
                        proc = subprocess.Popen(cmd, cwd=job.cwd, env=job.env, stdout=fh,
                                                stderr=subprocess.STDOUT, start_new_session=True)
                    self.run = fi.Run(proc, t0, job.log, cmd)
            rc = self.run.proc.wait() if not self.stopped else -9
            self.result[job.name] = (rc, time.time() - t0)
            self.done[job.name].set()

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
    """The lane of every selected module's background run (None when there is none), stopped
    at the end of the session; the summary after the durations gives each run's wall time."""
    jobs, seen = [], set()
    for item in request.session.items:
        found = _background(item)
        if found is not None and item.module.__name__ not in seen:
            seen.add(item.module.__name__)
            name = item.module.__name__
            jobs.append(_job(name, *found, tmp_path_factory.mktemp(name.rsplit(".", 1)[-1])))
    lane = Lane(jobs) if jobs else None
    yield lane
    if lane is not None:
        lane.stop()
        for job in jobs:
            if job.name in lane.result:
                rc, seconds = lane.result[job.name]
                _SUMMARY.append(f"background `python {' '.join(job.cmd[1:])}` ({job.name}): "
                                f"{seconds:.0f} s wall beside the suite, exit {rc} (its log: "
                                f"{job.log})")


def _waited(request, background_lane) -> tuple[Path, int, str]:
    name = request.module.__name__
    job = next(j for j in background_lane.jobs if j.name == name)
    rc, _ = background_lane.wait(name, timeout=1800)
    return job.folder, rc, job.log.read_text()


@pytest.fixture(scope="module")
def background_dag(request, background_lane) -> tuple[Path, int, str]:
    """This module's background DAG, waited for: (workflow copy, exit status, its output)."""
    return _waited(request, background_lane)


@pytest.fixture(scope="module")
def background_cmd(request, background_lane) -> tuple[Path, int, str]:
    """This module's background command, waited for: (its folder, exit status, its output)."""
    return _waited(request, background_lane)


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
