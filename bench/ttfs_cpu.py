"""CPU benchmark: time to first training step, cold (no compile cache) vs warm (after warmup).

    python -m bench.ttfs_cpu --spec specs/tiny.yaml --out bench/results/cpu/ttfs_tiny.json

In a temporary copy of the workflow (dflash.runtime.harness, as the tests do) with its own DFLASH_CACHE (the
converted SmolLM2 HF folder of the repo's cache is symlinked in, to skip the ~25 s conversion):

1. ``env_<spec>`` and ``data_<spec>`` through Snakemake, once.
2. warmup stage with an EMPTY compile cache (``<DFLASH_CACHE>/compile/<env fingerprint>/``):
   its per-(device, bucket) seconds are the cold compile cost per device.
3. train stage right after (the cache warmup filled): ``time_to_first_step_s`` and
   ``warm_start.seconds`` from the train manifest = time to first step after warmup.
4. compile cache deleted (the warmup manifest stays: its fingerprints still match),
   ``results/<spec>/train`` deleted (no resume), train stage again = cold, no warmup.

Both train runs happen in this one invocation, so their ratio shares the machine's load.
The derived spec ``<name>-ttfs`` differs from the given one only in its name and
``optim`` (``max_steps`` instead of ``epochs``): time to first step does not depend on the run
length, and every shape field (what warmup compiles) is unchanged.
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from dflash.runtime.harness import copy_workflow
from dflash.runtime.status import by_role

REPO = Path(__file__).resolve().parents[1]



def derived_spec(spec_path: Path, tmp: Path, max_steps: int) -> tuple[Path, dict]:
    data = yaml.safe_load(spec_path.read_text())
    name = f"{data['name']}-ttfs"
    optim_before = dict(data.get("optim", {}))
    optim = dict(optim_before)
    optim.pop("epochs", None)
    optim["max_steps"] = max_steps
    data["name"], data["optim"] = name, optim
    out = tmp / f"{name}.yaml"
    out.write_text(f"# Derived by bench/ttfs_cpu.py from {spec_path.name}: name and "
                   f"optim.max_steps only.\n" + yaml.safe_dump(data, sort_keys=False))
    return out, {"from": str(spec_path), "name": name, "optim_before": optim_before,
                 "optim_after": optim,
                 "note": "only the name and optim differ (max_steps instead of epochs); every "
                         "shape field that warmup compiles for is unchanged"}


def run_logged(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: int) -> float:
    """Run, stream to a log file, return process wall seconds; exit with the log tail on error."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                           timeout=timeout)
    wall = time.perf_counter() - t0
    print(f"  {' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}: rc {p.returncode}, "
          f"{wall:.1f}s", flush=True)
    if p.returncode != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-60:]), file=sys.stderr)
        raise SystemExit(f"failed: {cmd} (log {log})")
    return round(wall, 3)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "torch_git": torch.version.git_version,
           "inductor": f"torch._inductor from torch {torch.__version__}",
           "platform": platform.platform(), "machine": platform.machine(),
           "processor": platform.processor() or None,
           "cpu_count": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
           "torch_num_threads": torch.get_num_threads()}
    for pkg in ("transformers", "triton", "snakemake"):
        try:
            out[pkg] = md.version(pkg)
        except Exception:  # noqa: BLE001 - not installed
            out[pkg] = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                out["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return out


def train_figures(m: dict, wall: float) -> dict:
    """The manifest's time_to_first_step_s is warm start + the earliest first step of ANY worker,
    target workers included; the first drafter (training) step is added next to it."""
    drafter_first = min(by_role(m["first_step_s"], "drafter").values())
    return {"time_to_first_step_s": m["time_to_first_step_s"],
            "time_to_first_drafter_step_s": round(m["warm_start"]["seconds"] + drafter_first, 3),
            "warm_start_s": m["warm_start"]["seconds"],
            "warm_start_records": m["warm_start"]["records"],
            "first_step_s_after_warm_start": m["first_step_s"],
            "recompiles_after_warmup": m["gate"]["recompiles_after_warmup"],
            "race_errors": m["gate"]["race_errors"],
            "steps_run": m["steps"]["run_now"], "train_s": m["train_s"],
            "stage_wall_s_in_manifest": m["wall_s"], "process_wall_s": wall}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default="specs/tiny.yaml")
    ap.add_argument("--out", default="bench/results/cpu/ttfs_tiny.json")
    ap.add_argument("--max-steps", type=int, default=3,
                    help="optim.max_steps of the derived spec (default 3)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary workflow copy")
    ap.add_argument("--timeout", type=int, default=1200, help="per-stage limit, seconds")
    return ap.parse_args()


def setup(a: argparse.Namespace) -> dict:
    """The temporary workflow copy with the derived spec, its logs folder, and its own
    DFLASH_CACHE (converted SmolLM2 folders symlinked from the caller's cache)."""
    spec_path = (REPO / a.spec).resolve() if not Path(a.spec).is_absolute() else Path(a.spec)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-ttfs-"))
    wf = tmp / "wf"
    wf.mkdir()
    derived, derived_info = derived_spec(spec_path, tmp, a.max_steps)
    copy_workflow(wf, [derived])
    name = derived_info["name"]
    logs = tmp / "logs"
    logs.mkdir()
    cache = tmp / "cache"
    cache.mkdir()
    src_cache = Path(os.environ.get("DFLASH_CACHE", REPO / ".cache" / "dflash")).resolve()
    reused = []
    for hf in sorted(src_cache.glob("smollm2-135m-instruct-*-hf")):
        if (hf / "config.json").is_file():
            (cache / hf.name).symlink_to(hf, target_is_directory=True)
            reused.append(str(hf))
    env = dict(os.environ, DFLASH_CACHE=str(cache), PYTHONPATH=str(wf))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    return {"tmp": tmp, "wf": wf, "name": name, "spec_rel": f"specs/{name}.yaml", "logs": logs,
            "cache": cache, "env": env, "reused": reused, "derived_info": derived_info}


def measure(s: dict, timeout: int) -> dict:
    """env + data once; warmup on an empty compile cache; train right after it (warm); then
    the compile cache and the train folder deleted, train again (cold, no warmup)."""
    wf, env, logs, name, spec_rel = s["wf"], s["env"], s["logs"], s["name"], s["spec_rel"]
    load = {"start": loadavg()}
    walls = {}
    # 1. env + data, once
    walls["env+data (snakemake)"] = run_logged(
        [sys.executable, "-m", "snakemake", "--cores", "2", f"env_{name}", f"data_{name}"],
        wf, env, logs / "snakemake-env-data.log", timeout)
    res = wf / "results" / name
    env_fp = json.loads((res / "env" / "manifest.json").read_text())["fingerprints"]["env"]
    compile_dir = s["cache"] / "compile" / env_fp

    def stage(st: str, tag: str) -> float:
        return run_logged([sys.executable, "-m", "dflash", st, spec_rel, "--results", "results"],
                          wf, env, logs / f"{tag}.log", timeout)

    # 2. warmup on an empty compile cache: the cold compile cost per device
    shutil.rmtree(compile_dir, ignore_errors=True)
    load["before_warmup"] = loadavg()
    walls["warmup"] = stage("warmup", "warmup")
    wm = json.loads((res / "warmup" / "manifest.json").read_text())
    cache_bytes_after_warmup = du(compile_dir)

    # 3. train right after warmup: warm time to first step
    load["before_train_warm"] = loadavg()
    walls["train_warm"] = stage("train", "train-warm")
    warm = train_figures(json.loads((res / "train" / "manifest.json").read_text()),
                         walls["train_warm"])

    # 4. compile cache deleted, no resume: cold time to first step (no warmup)
    shutil.rmtree(compile_dir)
    shutil.rmtree(res / "train")
    load["before_train_cold"] = loadavg()
    walls["train_cold"] = stage("train", "train-cold")
    cold = train_figures(json.loads((res / "train" / "manifest.json").read_text()),
                         walls["train_cold"])
    load["end"] = loadavg()
    return {"walls": walls, "load": load, "wm": wm, "env_fp": env_fp, "warm": warm,
            "cold": cold, "cache_bytes_after_warmup": cache_bytes_after_warmup}


def method(name: str, spec_rel: str, reused: list[str]) -> dict:
    """How the figures were made, recorded with them."""
    return {
        "workflow": "temporary copy of the workflow (dflash.runtime.harness.copy_workflow), own "
                    "DFLASH_CACHE; converted SmolLM2 HF folder symlinked from " +
                    (", ".join(reused) or "nowhere (converted in the run)"),
        "env_data": f"snakemake --cores 2 env_{name} data_{name}",
        "stages": f"python -m dflash <warmup|train> {spec_rel} --results results "
                  "(one process each; process wall time measured around it)",
        "cold_warmup": "warmup stage run with an empty compile cache directory",
        "warm_train": "train stage right after warmup (the cache warmup filled)",
        "cold_train": "compile cache directory deleted, warmup manifest kept (fingerprints "
                      "still match), results/<spec>/train deleted so it does not resume",
        "time_to_first_step_s": "train manifest: warm-start seconds + the earliest first "
                                "step of any worker after the warm start (target workers "
                                "included)",
        "time_to_first_drafter_step_s": "warm-start seconds + the earliest first step of a "
                                        "drafter worker (the first training step), from "
                                        "the train manifest's first_step_s",
        "load": "2 shared cores; loadavg_1_5_15 records the machine's load at each stage, "
                "since other jobs may run at the same time (ratios come from one run)",
        "replicas": "both drafter replicas are threads on the same CPU; they are warmed one "
                    "after the other, so replica #1 reuses what replica #0 compiled",
    }


def report(s: dict, m: dict, total: float) -> dict:
    """The result JSON: the spec, the environment, the method and the figures."""
    wm, warm, cold, walls = m["wm"], m["warm"], m["cold"], m["walls"]
    per_bucket = [{k: r[k] for k in ("device", "replica", "bucket", "callable", "seconds")}
                  for r in wm["compiled"]]
    return {
        "benchmark": "time to first training step on CPU: cold (no warmup) vs after warmup",
        "command": "python -m bench.ttfs_cpu " + " ".join(sys.argv[1:]),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "spec": s["derived_info"] | {"shape_fingerprint": wm["fingerprints"]["shape"],
                                     "buckets": wm["buckets"]},
        "environment": versions() | {"env_fingerprint": m["env_fp"]},
        "method": method(s["name"], s["spec_rel"], s["reused"]),
        "results": {
            "warmup_cold_cache": {
                "seconds_per_device": wm["seconds_per_device"],
                "per_device_bucket": per_bucket,
                "seconds_total_in_manifest": wm["seconds_total"],
                "process_wall_s": walls["warmup"],
                "compile_cache_bytes_after": m["cache_bytes_after_warmup"],
            },
            "train_after_warmup": warm,
            "train_cold_no_warmup": cold,
            "ratio_time_to_first_step_cold_over_warm": round(
                cold["time_to_first_step_s"] / warm["time_to_first_step_s"], 2),
            "ratio_time_to_first_drafter_step_cold_over_warm": round(
                cold["time_to_first_drafter_step_s"] / warm["time_to_first_drafter_step_s"], 2),
            "ratio_warm_start_cold_over_warm": round(
                cold["warm_start_s"] / warm["warm_start_s"], 2),
        },
        "process_wall_s": walls,
        "loadavg_1_5_15": m["load"],
        "total_runtime_s": total,
    }


def main() -> int:
    a = parse()
    t_all = time.perf_counter()
    s = setup(a)
    print(f"[ttfs] workflow copy {s['wf']}; DFLASH_CACHE {s['cache']}; spec {s['spec_rel']}",
          flush=True)
    m = measure(s, a.timeout)
    total = round(time.perf_counter() - t_all, 1)
    result = report(s, m, total)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    r, wm, warm, cold = result["results"], m["wm"], m["warm"], m["cold"]
    print(f"[ttfs] warmup (cold cache) per device: {wm['seconds_per_device']}; "
          f"time to first step: cold {cold['time_to_first_step_s']:.1f}s, after warmup "
          f"{warm['time_to_first_step_s']:.1f}s "
          f"({r['ratio_time_to_first_step_cold_over_warm']}x); first drafter step: cold "
          f"{cold['time_to_first_drafter_step_s']:.1f}s, after warmup "
          f"{warm['time_to_first_drafter_step_s']:.1f}s "
          f"({r['ratio_time_to_first_drafter_step_cold_over_warm']}x); total {total:.0f}s -> {out}",
          flush=True)
    if a.keep:
        print(f"[ttfs] kept {s['tmp']}")
    else:
        shutil.rmtree(s["tmp"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
