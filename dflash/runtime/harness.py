"""A temporary copy of the workflow to run Snakemake and the stage commands in, for real: the
end-to-end tests and the benchmark scripts share it (they import it from the installed package,
never each other).

Needs the repository checkout the package is installed from (``pip install -e .``): the copy
takes its Snakefile, rules, config, profile, package and locks.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_FILES = ["Snakefile", "rules", "config", "profiles", "report", "dflash", "envs"]
# The thread counts Snakemake gives a rule's job (threads: 1). A stage started alone must compute
# exactly as the same stage under Snakemake: float sums depend on the number of intra-op threads,
# so a run resumed under the other launcher would not be bit-identical.
JOB_THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                   "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def copy_workflow(dst: Path, specs: list[Path]) -> Path:
    if not (REPO / "Snakefile").is_file():
        raise RuntimeError(f"{REPO}: not a checkout of the workflow (install with pip -e)")
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


def workflow_env(wf: Path, **extra: str) -> dict:
    """The environment stages run in: the copy's package first, the shared converted-target and
    compile caches (the first SmolLM2 conversion takes ~20 s), no injected failures."""
    env = dict(os.environ)
    env.setdefault("DFLASH_CACHE", str(REPO / ".cache" / "dflash"))
    env["PYTHONPATH"] = str(wf)
    env.pop("DFLASH_FAIL_AT", None)
    env.update(extra)
    return env


def stage_env(wf: Path) -> dict:
    """:func:`workflow_env` with the thread counts of a Snakemake job (see JOB_THREAD_VARS)."""
    return workflow_env(wf, **{k: "1" for k in JOB_THREAD_VARS})


def snakemake(wf: Path, *args: str, env: dict | None = None, timeout: int = 900
              ) -> subprocess.CompletedProcess:
    e = workflow_env(wf)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args], cwd=wf,
                          env=e, capture_output=True, text=True, timeout=timeout)


def units_held(output: str, resource: str = "cuda_0") -> dict[str, int | None]:
    """What each job of a dry run's output holds of ``resource``: {rule: units}, None for a job
    that holds none (the last job of a rule stands for it)."""
    rule, got = None, {}
    for line in output.splitlines():
        line = line.strip()
        if line.startswith("rule ") and line.endswith(":"):
            rule = line[5:-1]
            got.setdefault(rule, None)
        elif line.startswith("resources:") and f"{resource}=" in line:
            got[rule] = int(line.split(f"{resource}=")[1].split(",")[0])
    return got


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table Snakemake prints: {rule: count}, without named targets."""
    m = re.search(r"Job stats:\n(.*?)\ntotal", output, re.S)
    if not m:
        return {}
    rows = [ln.split() for ln in m.group(1).splitlines()[2:] if ln.strip()]
    return {r[0]: int(r[1]) for r in rows if len(r) == 2 and "_" not in r[0]}
