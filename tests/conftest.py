"""Shared fixtures: a temporary copy of the workflow to run Snakemake in for real."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = ["Snakefile", "rules", "config", "profiles", "dflash", "envs"]


def copy_workflow(dst: Path, specs: list[Path]) -> Path:
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dst / name)
    (dst / "specs").mkdir()
    for s in specs:
        shutil.copy2(s, dst / "specs" / s.name)
    return dst


def snakemake(wf: Path, *args: str, env: dict | None = None, timeout: int = 900
              ) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    # share the converted target and compile caches between tests (and with the repo)
    e.setdefault("DFLASH_CACHE", str(REPO / ".cache" / "dflash"))
    e["PYTHONPATH"] = str(wf)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=wf,
                          env=e, capture_output=True, text=True, timeout=timeout)


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table Snakemake prints: {rule: count}, without named targets."""
    m = re.search(r"Job stats:\n(.*?)\ntotal", output, re.S)
    if not m:
        return {}
    rows = [ln.split() for ln in m.group(1).splitlines()[2:] if ln.strip()]
    return {r[0]: int(r[1]) for r in rows if len(r) == 2 and "_" not in r[0]}


@pytest.fixture(scope="session")
def micro_spec() -> Path:
    return REPO / "tests" / "specs" / "micro.yaml"


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test (tiny tensors; robust to a busy machine)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
