"""Where the compiled target's cold warm-up goes (issue 24: "cold warm-up of the compiled 8B
target under 90 s, or the reason it cannot be, measured").

Each arm runs in its OWN subprocess with fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` under /tmp (arms never share a cache), builds the Qwen3-8B-shaped target as
training does (:func:`dflash.models.target.load_target`, random weights, bf16, FlexAttention,
``--layers`` decoder layers: with regional compile, 2 layers compile the same ONE graph as 36)
and runs :class:`dflash.models.features.FeatureExtractor` (compile "inductor") in a worker thread
set up like the warm-up's (:func:`dflash.runtime.tracing.worker_thread_setup`) on one packed
row of ``--batch`` documents of ``--seq`` tokens. Measured, each call ending in a device sync:

* ``mask_first_s``: the first document BlockMask build (from the documents' boundaries, no
  compile; a compiled ``create_block_mask`` until 2026-12-02: 236 s of 240 s cold);
* ``layers_first_s``: the first extractor call after it (the layer graph, flex inside);
* ``settle_s`` / ``settle_new_graphs``: the warm-up's second call with another document layout
  (a recompile here would be one more graph per bucket);
* ``steady``: ms per forward (best of ``--iters``) of the loaded layers, the mask build alone,
  per layer, and the extrapolation to the 34 layers training runs (``est_34_layers_ms``);
  ``captured`` (CUDA): the same forward as training runs it there, one CUDA graph per row
  length (the capture's seconds, whether it fell back, ms per forward).

The breakdown is torch's own: every ``dynamo_timed`` key of
``torch._dynamo.utils.compilation_time_metrics`` summed over the call (``keys``), folded into
``phases`` (dynamo tracing = frame compile − backend; AOTAutograd = backend − inductor;
inductor lowering, codegen, the wait on the parallel Triton compile workers, compile-time and
run-time autotuning; ``outside_compile_s`` = the call minus dynamo's frame compile: first
execution, run-time autotune, lazy loads), and per graph the ``CompilationMetrics`` records
(``torch._dynamo.utils.get_compilation_metrics``: co_name, per-phase microseconds, Triton
kernel compile times where this torch records them). ``--torch-trace DIR`` also writes each
arm's ``TORCH_TRACE`` structured log (chromium events, for tlparse).

Arms (:data:`ARMS`): ``today``; ``fixed-flex``
(``DFLASH_FLEX_KERNEL_OPTIONS`` = inductor's own H100/H200 bf16 d128 choice, so no search
could run); ``threads1`` / ``threads-cores`` (``TORCHINDUCTOR_COMPILE_THREADS``: no pool / the
usable cores); ``flex-alone`` (only flex_attention on the layer's q/k/v: the attention kernel's
own share); ``megacache`` (empty caches, then ``torch.compiler.load_cache_artifacts`` of the
blob the ``today`` arm saved with ``save_cache_artifacts``: a shipped warm cache, NOT a cold
compile). Arms run ``--parallel N`` at a time (concurrent arms share the CPU cores: their
compile seconds are then upper bounds; the JSON records each arm's start/end and overlap).

    python3 -m bench.gpu.cold_compile --arms today,fixed-flex,threads-cores,\
flex-alone,megacache --parallel 5 --out $OUT/cold_compile.json --torch-trace $OUT/trace
    python3 -m bench.gpu.cold_compile --smoke --out /tmp/cold_smoke.json   # CPU, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch._inductor.config as inductor_config

from bench.gpu.cold_probe import ARMS, ENV_KEYS, ROOT, cache_counts, child, usable_cores
from dflash.artifacts.manifest import atomic_write_json


# ---------------------------------------------------------------------------------------------
# the parent: one subprocess per arm, fresh caches, N at a time
# ---------------------------------------------------------------------------------------------
SHARED_ARGS = ("device", "model", "dtype", "backend", "attention", "layers", "batch", "seq",
               "iters")


def run_arm(name: str, a, producers: dict[str, Future], work: Path) -> dict:
    """One arm in a fresh subprocess with empty caches; its JSON plus wall-clock facts."""
    arm = ARMS[name]
    cache = tempfile.mkdtemp(prefix=f"cold-{name}-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    env.update({"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor",
                "TRITON_CACHE_DIR": f"{cache}/triton", **dict(arm.env)})
    if a.torch_trace:
        env["TORCH_TRACE"] = str(Path(a.torch_trace, name))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    out, log = work / f"{name}.json", work / f"{name}.log"
    cmd = [sys.executable, "-m", "bench.gpu.cold_compile", "--child", name,
           "--child-out", str(out), "--gpu-lock", str(work / "gpu.lock")]
    for k in SHARED_ARGS:
        if getattr(a, k) is not None:
            cmd += [f"--{k}", str(getattr(a, k))]
    if a.smoke:
        cmd.append("--smoke")
    if name in a.producers:
        cmd += ["--save-artifacts", str(work / f"{name}.artifacts")]
    if arm.needs:
        blob = producers[arm.needs].result()  # waits for the producing arm
        if blob is None:
            return {"error": f"arm {arm.needs!r} failed or saved no cache artifacts file"}
        cmd += ["--load-artifacts", blob]
    left = a.t0 + a.total_s - time.time()  # the whole run stays inside one device call
    if left < 10:
        return {"skipped": f"--total-s {a.total_s} spent before this arm could start"}
    res = _spawn(cmd, env, log, min(a.arm_timeout, left))
    if out.is_file():
        res.update(json.loads(out.read_text()))
    res["caches"] = cache_counts(cache)
    res["what"] = arm.what
    if not a.keep_caches:
        shutil.rmtree(cache, ignore_errors=True)
    return res


def _spawn(cmd: list[str], env: dict, log: Path, timeout: float) -> dict:
    """Run ``cmd`` in its own process group (a timeout kills the child and its compile
    workers); rc, wall seconds, start/end, and the log's tail on failure."""
    start = time.time()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=ROOT)
        try:
            rc: int | str = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the group this call started, nothing else
            p.wait()
            rc = "timeout"
    res: dict = {"rc": rc, "wall_s": round(time.time() - start, 2), "start_unix": round(start, 2),
                 "end_unix": round(time.time(), 2)}
    if rc != 0:
        res["log_tail"] = log.read_text(errors="replace")[-3000:]
    return res


def schedule(a, names: list[str], work: Path, save) -> dict[str, dict]:
    """Run the arms ``a.parallel`` at a time (producers first); ``save(results)`` after each."""
    results: dict[str, dict] = {}
    producers: dict[str, Future] = {n: Future() for n in a.producers}  # before any job starts
    deadline = time.time() + a.budget_s

    def job(name: str) -> dict:
        if name in a.skip:
            return {"skipped": a.skip[name]}
        if time.time() > deadline:
            return {"skipped": f"--budget-s {a.budget_s} spent before this arm started"}
        return run_arm(name, a, producers, work)

    order = sorted(names, key=lambda n: ARMS[n].needs is not None)  # a consumer waits: last
    with ThreadPoolExecutor(max_workers=a.parallel) as pool:
        futs = {n: pool.submit(job, n) for n in order}
        for n in a.producers:
            _blob_when_done(futs[n], producers[n], work / f"{n}.artifacts")
        for n in order:
            try:
                results[n] = futs[n].result()
            except Exception as e:  # noqa: BLE001 - one broken arm must not lose the others
                results[n] = {"error": f"{type(e).__name__}: {e}"}
            save(results)
    return results


def _blob_when_done(fut: Future, blob: Future, path: Path) -> None:
    """When the producer ends, ``blob`` gets its saved blob's path (None: it saved nothing)."""
    fut.add_done_callback(lambda f: blob.set_result(
        str(path) if not f.exception() and path.is_file() else None))  # empty: nothing cached


GOAL_S = 90.0  # issue 24: the cold warm-up of the compiled 8B target under 90 s


def summary(results: dict[str, dict]) -> dict:
    """Per arm: the first call's seconds (the compile), the biggest phase of the layer call,
    the steady-state forward, and whether the first call is under the goal."""
    out = {}
    for n, r in results.items():
        if "first_call_s" not in r:
            continue
        first = r.get("layers_first") or r.get("flex_first") or {}
        ph = {k: v for k, v in first.get("phases", {}).items()
              if k not in ("frame_compile_s", "inductor_total_s")}
        out[n] = {"first_call_s": r["first_call_s"], "under_goal": r["first_call_s"] < GOAL_S,
                  "largest_phase": max(ph, key=ph.get) if ph else None,
                  "steady": r.get("steady"),
                  "captured_forward_ms": (r.get("captured") or {}).get("forward_ms")}
    return {"goal_s": GOAL_S, "arms": out}


def overlaps(results: dict[str, dict]) -> None:
    """Each arm's concurrently running arms (their compiles shared the CPU cores)."""
    span = {n: (r["start_unix"], r["end_unix"]) for n, r in results.items() if "start_unix" in r}
    for n, (s, e) in span.items():
        results[n]["ran_with"] = [m for m, (s2, e2) in span.items() if m != n and s2 < e and s < e2]


SMOKE = {"device": "cpu", "dtype": "float32", "backend": "aot_eager", "attention": "sdpa",
         "layers": 2, "batch": 2, "seq": 64, "iters": 2, "model": None}
GPU = {"device": "cuda:0", "dtype": "bfloat16", "backend": "inductor", "attention": "flex",
       "layers": 2, "batch": 16, "seq": 1024, "iters": 5, "model": "qwen3-8b"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="today,fixed-flex,threads-cores,flex-alone,"
                   "megacache", help=f"comma-separated, of: {', '.join(ARMS)}")
    p.add_argument("--parallel", type=int, default=6, help="arms running at once (an arm "
                   "waiting for another's artifacts holds a slot)")
    p.add_argument("--out", help="the JSON to write (required unless --child)")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny random Qwen3, aot_eager: "
                   "the harness in seconds (the timings mean nothing)")
    for k, v in GPU.items():
        p.add_argument(f"--{k}", type=type(v) if v is not None else str, default=None,
                       help=f"default {v!r} ({SMOKE[k]!r} with --smoke)")
    p.add_argument("--arm-timeout", type=float, default=330.0, help="seconds per arm")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="no arm starts after this many seconds")
    p.add_argument("--total-s", type=float, default=480.0,
                   help="every arm is killed by then (seconds after the start)")
    p.add_argument("--torch-trace", help="a folder: each arm's TORCH_TRACE log goes under it")
    p.add_argument("--keep-caches", action="store_true")
    for k in ("--child", "--child-out", "--save-artifacts", "--load-artifacts", "--gpu-lock"):
        p.add_argument(k, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k, v in (SMOKE if a.smoke else GPU).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return p, a


def arm_names(p, a) -> list[str]:
    names = [n.strip() for n in a.arms.split(",") if n.strip()]
    bad = [n for n in names if n not in ARMS]
    if bad or not names:
        p.error(f"--arms: unknown {bad} (known: {', '.join(ARMS)})")
    for n in list(names):  # an arm that loads another's artifacts brings its producer
        if ARMS[n].needs and ARMS[n].needs not in names:
            names.insert(0, ARMS[n].needs)
    a.producers = sorted({ARMS[n].needs for n in names if ARMS[n].needs})
    a.skip = {}
    if "threads-cores" in names and default_compile_threads() == usable_cores():
        a.skip["threads-cores"] = (f"torch's default compile_threads is already "
                                   f"{usable_cores()}, the usable cores: the same as 'today'")
    return names


def default_compile_threads() -> int:
    """inductor's compile_threads in a child (which never inherits the env override)."""
    saved = os.environ.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    try:
        return inductor_config.decide_compile_threads()
    except Exception:  # noqa: BLE001 - a torch without it: never skip, never fail the run
        return -1
    finally:
        if saved is not None:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = saved


def main(argv=None) -> None:
    p, a = parse(argv)
    if a.child:
        child(a)
        return
    if not a.out or a.parallel < 1:
        p.error("--out is required and --parallel must be >= 1")
    names = arm_names(p, a)
    t0 = a.t0 = time.time()
    work = Path(tempfile.mkdtemp(prefix="cold-compile-", dir="/tmp"))
    doc = {"command": shlex.join(["python3", "-m", "bench.gpu.cold_compile", *(argv or sys.argv[1:])]),
           "arms_requested": names, "parallel": a.parallel, "smoke": a.smoke,
           "usable_cores": usable_cores(), "default_compile_threads": default_compile_threads(),
           "config": {k: getattr(a, k) for k in SHARED_ARGS},
           "arm_meaning": {n: ARMS[n].what for n in names}}

    def save(results: dict) -> None:
        overlaps(results)
        doc.update(arms=results, summary=summary(results), wall_s=round(time.time() - t0, 2))
        atomic_write_json(a.out, doc)

    results = schedule(a, names, work, save)
    save(results)
    shutil.rmtree(work, ignore_errors=True)
    for n, r in results.items():
        first = r.get("first_call_s", r.get("error") or r.get("skipped") or r.get("rc"))
        print(f"[cold] {n}: first call {first} s, steady {r.get('steady')}, "
              f"wall {r.get('wall_s')} s", flush=True)
    print(f"[cold] wrote {a.out} in {doc['wall_s']} s", flush=True)


if __name__ == "__main__":
    main()
