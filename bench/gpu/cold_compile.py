"""Where the compiled target's cold warm-up goes (issue 24: "cold warm-up of the compiled 8B
target under 90 s, or the reason it cannot be, measured").

Each arm runs in its OWN subprocess with fresh, empty ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` under /tmp (arms never share a cache), builds the Qwen3-8B-shaped target as
training does (:func:`dflash.models.target.load_target`, random weights, bf16, FlexAttention,
``--layers`` decoder layers: with regional compile, 2 layers compile the same ONE graph as 36)
and runs :class:`dflash.models.features.FeatureExtractor` (compile "inductor") in a worker thread
set up like the warm-up's (:func:`dflash.runtime.tracing.worker_thread_setup`) on one packed
row of ``--batch`` documents of ``--seq`` tokens. Measured, each call ending in a device sync:

* ``mask_first_s``: the first document BlockMask build (a compiled kernel today);
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

Arms (:data:`ARMS`): ``today``; ``eager-mask`` (``DFLASH_TARGET_MASK=eager``); ``fixed-flex``
(``DFLASH_FLEX_KERNEL_OPTIONS`` = inductor's own H100/H200 bf16 d128 choice, so no search
could run); ``threads1`` / ``threads-cores`` (``TORCHINDUCTOR_COMPILE_THREADS``: no pool / the
usable cores); ``flex-alone`` (only flex_attention on the layer's q/k/v: the attention kernel's
own share); ``megacache`` (empty caches, then ``torch.compiler.load_cache_artifacts`` of the
blob the ``today`` arm saved with ``save_cache_artifacts``: a shipped warm cache, NOT a cold
compile). Arms run ``--parallel N`` at a time (concurrent arms share the CPU cores: their
compile seconds are then upper bounds; the JSON records each arm's start/end and overlap).

    PYTHONPATH=$PWD python3 bench/gpu/cold_compile.py --arms today,eager-mask,fixed-flex,threads-cores,\
flex-alone,megacache --parallel 6 --out $OUT/cold_compile.json --torch-trace $OUT/trace
    python3 bench/gpu/cold_compile.py --smoke --out /tmp/cold_smoke.json   # CPU, seconds
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import compilation_time_metrics, counters, get_compilation_metrics
from torch.nn.attention.flex_attention import flex_attention
from transformers import Qwen3Config

from dflash import settings
from dflash.manifest import atomic_write_json, file_lock
from dflash.models.drafter import head_dim_of
from dflash.models.features import FeatureExtractor
from dflash.models.masks import document_block_mask, document_dense_mask
from dflash.models.target import hf_config, load_target
from dflash.models.target_graph import CapturedFeatures
from dflash.runtime.gate import get_gate
from dflash.runtime.tracing import worker_thread_setup
from dflash.spec import section_spec
from dflash.train.warm import synthetic_row

ROOT = Path(__file__).resolve().parents[2]

# the inductor default for (bf16, head_dim 128) on sm90 (torch/_inductor/template_heuristics/
# triton.py, h100_default_flex_config): fixing it changes no kernel, only forbids a search
FIXED_FLEX = "BLOCK_M=128,BLOCK_N=64,num_stages=3,num_warps=8"


@dataclasses.dataclass(frozen=True)
class Arm:
    what: str
    env: tuple[tuple[str, str], ...] = ()
    probe: str = "target"  # "target": the extractor; "flex": flex_attention alone
    needs: str | None = None  # the arm whose saved cache artifacts this one loads


def usable_cores() -> int:
    """CPU cores this process may use: the affinity mask, capped by a cgroup v2 quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return int(n or 1)


ARMS: dict[str, Arm] = {
    "today": Arm("today's code path: compiled layer graph (flex inline), compiled BlockMask "
                 "build, torch's default compile_threads"),
    "eager-mask": Arm("BlockMask built eagerly (DFLASH_TARGET_MASK=eager): one graph fewer",
                      (("DFLASH_TARGET_MASK", "eager"),)),
    "fixed-flex": Arm(f"flex kernel options fixed (DFLASH_FLEX_KERNEL_OPTIONS={FIXED_FLEX})",
                      (("DFLASH_FLEX_KERNEL_OPTIONS", FIXED_FLEX),)),
    "threads1": Arm("TORCHINDUCTOR_COMPILE_THREADS=1: no parallel compile workers",
                    (("TORCHINDUCTOR_COMPILE_THREADS", "1"),)),
    "threads-cores": Arm("TORCHINDUCTOR_COMPILE_THREADS = the usable cores (affinity, cgroup)",
                         (("TORCHINDUCTOR_COMPILE_THREADS", str(usable_cores())),)),
    "flex-alone": Arm("only flex_attention on the layer's q/k/v compiled: its kernel's share",
                      probe="flex"),
    "megacache": Arm("empty caches + torch.compiler.load_cache_artifacts of the 'today' arm's "
                     "save_cache_artifacts blob (a shipped warm cache, not a cold compile)",
                     needs="today"),
}

# torch's dynamo_timed keys (torch/_dynamo/utils.py), nested: each includes the ones below it
KEYS = {"frame": "_compile.compile_inner", "backend": "OutputGraph.call_user_compiler",
        "inductor": "compile_fx_inner", "lowering": "GraphLowering.run",
        "codegen": "GraphLowering.compile_to_module", "triton_wait": "async_compile.wait",
        "triton_precompile": "async_compile.precompile",
        "runtime_autotune": "CachingAutotuner.benchmark_all_configs",
        "coordesc_autotune": "CachingAutotuner.coordinate_descent_tuning"}


# ---------------------------------------------------------------------------------------------
# the child: one arm, one process, empty caches
# ---------------------------------------------------------------------------------------------
def _snapshot() -> dict[str, int]:
    return {k: len(v) for k, v in compilation_time_metrics.items()}


def _since(snap: dict[str, int]) -> dict[str, float]:
    """Seconds per dynamo_timed key recorded since ``snap``."""
    out = {k: sum(v[snap.get(k, 0):]) for k, v in compilation_time_metrics.items()}
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= 5e-4}


def phases(keys: dict[str, float], call_s: float) -> dict[str, float]:
    """The nested keys folded into exclusive phases (seconds)."""
    g = {name: keys.get(k, 0.0) for name, k in KEYS.items()}
    autotune = sum(v for k, v in keys.items() if k.endswith(("_template_autotuning",
                                                             "_template_precompiling"))
                   or k == "benchmark_fused_nodes")
    cache_load = keys.get("AOTAutogradCache.inductor_load", 0.0)  # a cache hit skips inductor
    out = {"dynamo_trace_s": g["frame"] - g["backend"],
           "aot_autograd_s": g["backend"] - g["inductor"] - cache_load,
           "cache_load_s": cache_load,
           "inductor_total_s": g["inductor"],
           "inductor_lowering_s": g["lowering"],
           "inductor_codegen_s": g["codegen"],
           "triton_compile_wait_s": g["triton_wait"] + g["triton_precompile"],
           "compile_time_autotune_s": autotune,
           "runtime_autotune_s": g["runtime_autotune"] + g["coordesc_autotune"],
           "frame_compile_s": g["frame"],
           "outside_compile_s": call_s - g["frame"]}
    return {k: round(v, 3) for k, v in out.items()}


def graph_records(start: int) -> list[dict]:
    """torch's CompilationMetrics of every frame compiled since record ``start``: its name and
    non-empty timing fields (a field this torch lacks is simply absent)."""
    out = []
    for m in list(get_compilation_metrics())[start:]:
        d = dataclasses.asdict(m)
        rec = {k: d[k] for k in ("co_name", "compile_id", "graph_op_count", "fail_type")
               if d.get(k) is not None}
        rec.update({k: v for k, v in d.items() if v and k.endswith(("_us", "_time_s"))
                    and isinstance(v, (int, float))})
        if d.get("triton_kernel_compile_times_us"):
            rec["triton_kernel_compile_times_us"] = d["triton_kernel_compile_times_us"]
        out.append(rec)
    return out


def timed_first(fn, sync) -> tuple[object, dict]:
    """Run ``fn`` once: its seconds, torch's keys and phases for that call, new graphs."""
    snap, graphs = _snapshot(), counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    out = fn()
    sync()
    sec = time.perf_counter() - t0
    keys = _since(snap)
    return out, {"seconds": round(sec, 3), "new_graphs": counters["stats"]["unique_graphs"] -
                 graphs, "phases": phases(keys, sec), "keys": keys}


def best_ms(fn, sync, iters: int) -> float:
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 3)


def gpu_alone(a):
    """Held while an arm times its steady state: concurrent arms share one GPU, so only one
    times at a time (their compiles still overlap)."""
    return file_lock(a.gpu_lock) if a.gpu_lock else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# what an arm measures
# ---------------------------------------------------------------------------------------------
def tiny_qwen3_dir() -> str:
    """A tiny random Qwen3-shaped model folder (config.json only) for --smoke."""
    d = tempfile.mkdtemp(prefix="cold-smoke-model-", dir="/tmp")
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=512,
                max_position_embeddings=4096).save_pretrained(d)
    return d


def target_spec(a):
    return section_spec("target", {"model": a.model or tiny_qwen3_dir(), "init": "random",
                                   "dtype": a.dtype, "num_feature_layers": 1})


def probe_target(a, dev: str, sync) -> dict:
    """The extractor's first calls (mask, layers, the warm-up's settle) and its steady state."""
    t0 = time.perf_counter()
    t = load_target(target_spec(a), dev, need_tokenizer=False, num_layers=a.layers,
                    attention=a.attention)
    t = dataclasses.replace(t, layer_ids=[a.layers - 1])
    fx = FeatureExtractor(t, compile=a.backend)
    L, vocab = a.batch * a.seq, t.model.config.vocab_size
    rows = [synthetic_row(L, vocab, docs=a.batch), synthetic_row(L, vocab, seed=1, docs=3)]
    (xi, di, pi), (x2, d2, p2) = ((r.input_ids.to(dev), r.doc_ids.to(dev),
                                   r.position_ids.to(dev)) for r in rows)
    res: dict = {"build_s": round(time.perf_counter() - t0, 3), "tokens": L,
                 "mask_compiled": fx.mask_compiled, "flex_options": fx.flex_options}

    def mask(d=di):  # the mask exactly as FeatureExtractor._run builds it
        return (document_block_mask(d, _compile=fx.mask_compiled) if a.attention == "flex"
                else document_dense_mask(d))

    gate = get_gate()
    _, res["mask_first"] = timed_first(lambda: gate.run(("mask", dev, L), mask), sync)
    _, res["layers_first"] = timed_first(
        lambda: gate.run(("target_forward", dev, L), lambda: fx(xi, di, pi)), sync)
    with gate.exclusive("settle"):  # the warm-up's second call: another document layout
        _, res["settle"] = timed_first(lambda: fx(x2, d2, p2), sync)
    with gpu_alone(a):
        fwd, mask_ms = (best_ms(lambda: fx(xi, di, pi), sync, a.iters),
                        best_ms(mask, sync, a.iters))
    per_layer = (fwd - mask_ms) / a.layers
    res["steady"] = {"forward_ms": fwd, "mask_ms": mask_ms, "per_layer_ms": round(per_layer, 3),
                     "layers": a.layers,
                     "est_34_layers_ms": round(fwd + per_layer * (34 - a.layers), 2)}
    res["first_call_s"] = round(res["mask_first"]["seconds"] + res["layers_first"]["seconds"],
                                3)
    if dev.startswith("cuda"):
        try:
            res["captured"] = captured_steady(fx, dev, (xi, di, pi), sync, a)
        except Exception as e:  # noqa: BLE001 - the compile figures above must survive
            res["captured"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return res


def captured_steady(fx, dev: str, row, sync, a) -> dict:
    """The extractor as training runs it on CUDA (``target.cuda_graph`` auto: one CUDA graph per
    row length, :class:`dflash.models.target_graph.CapturedFeatures`): the capture's seconds,
    whether it fell back to the uncaptured forward (an eager BlockMask build may not capture),
    and ms per forward."""
    said: list[str] = []
    cf = CapturedFeatures(fx, dev, log=said.append)
    _, first = timed_first(lambda: cf(*row), sync)
    with gpu_alone(a):
        ms = best_ms(lambda: cf(*row), sync, a.iters)
    return {"capture_s": first["seconds"], "capture_new_graphs": first["new_graphs"],
            "fell_back": bool(said), "log": said[:1], "forward_ms": ms}


def probe_flex(a, dev: str, sync) -> dict:
    """flex_attention alone on one layer's q/k/v (the packed row, document BlockMask built
    eagerly): the attention kernel's own compile and time."""
    cfg = hf_config(target_spec(a))
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
    L = a.batch * a.seq
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, L, hd, device=dev, dtype=getattr(torch, a.dtype), generator=g)
               for h in (hq, hkv, hkv))
    mask = document_block_mask(synthetic_row(L, 8, docs=a.batch).doc_ids.to(dev))
    flex = torch.compile(flex_attention, backend=a.backend, dynamic=False)
    opts = settings.flex_kernel_options()

    def fn():
        return flex(q, k, v, block_mask=mask, scale=hd ** -0.5, enable_gqa=hq != hkv,
                    kernel_options=opts)

    _, first = timed_first(fn, sync)
    with gpu_alone(a):
        steady = {"flex_ms": best_ms(fn, sync, a.iters)}
    return {"tokens": L, "flex_options": opts, "flex_first": first,
            "first_call_s": first["seconds"], "steady": steady}


def cache_counts(root: str) -> dict:
    """Files under the arm's inductor and triton caches (how much was compiled)."""
    out = {}
    for sub in ("inductor", "triton"):
        files = [p for p in Path(root, sub).rglob("*") if p.is_file()]
        out[sub] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
    out["triton_kernels"] = sum(1 for _ in Path(root, "triton").rglob("*.json")
                                if not _.name.startswith("__grp__"))
    return out


def child(a) -> None:
    """One arm in this process (its caches are empty: the parent made them)."""
    t_child = time.perf_counter()
    dev = a.device
    cuda = dev.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    if a.smoke:
        torch.set_num_threads(1)  # tiny tensors: threads only contend on a busy machine
    t0 = time.perf_counter()
    if cuda:
        torch.ones(1, device=dev).sum().item()
    res: dict = {"arm": a.child, "probe": ARMS[a.child].probe, "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(dev) if cuda else dev,
                 "device_init_s": round(time.perf_counter() - t0, 3),
                 "compile_threads": inductor_config.compile_threads,
                 "env": {k: os.environ.get(k) for k in ENV_KEYS}}
    if a.load_artifacts:
        blob = Path(a.load_artifacts).read_bytes()
        t0 = time.perf_counter()
        info = torch.compiler.load_cache_artifacts(blob) if blob else None
        res["artifacts_loaded"] = {"bytes": len(blob), "seconds": round(time.perf_counter() - t0,
                                                                       3),
                                   "entries": _artifact_counts(info)}
    start = len(get_compilation_metrics())
    probe = probe_flex if ARMS[a.child].probe == "flex" else probe_target
    with ThreadPoolExecutor(max_workers=1, initializer=worker_thread_setup) as pool:
        res.update(pool.submit(probe, a, dev, sync).result())  # as the warm-up: a worker thread
    res["graphs"] = graph_records(start)
    if a.save_artifacts:
        t0 = time.perf_counter()
        saved = torch.compiler.save_cache_artifacts()
        blob = saved[0] if saved else b""
        Path(a.save_artifacts).write_bytes(blob)
        res["artifacts_saved"] = {"bytes": len(blob), "seconds": round(time.perf_counter() - t0,
                                                                      3),
                                  "entries": _artifact_counts(saved[1] if saved else None)}
    res["child_s"] = round(time.perf_counter() - t_child, 3)  # wall_s - child_s: start-up
    atomic_write_json(a.child_out, res)


def _artifact_counts(info) -> dict:
    arts = getattr(info, "artifacts", None) or {}
    return {k: len(v) for k, v in arts.items()}


ENV_KEYS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS",
            "DFLASH_TARGET_MASK", "DFLASH_FLEX_KERNEL_OPTIONS", "TORCH_TRACE")


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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name,
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
    p.add_argument("--arms", default="today,eager-mask,fixed-flex,threads-cores,flex-alone,"
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
    doc = {"command": shlex.join(["python3", "bench/gpu/cold_compile.py", *(argv or sys.argv[1:])]),
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
