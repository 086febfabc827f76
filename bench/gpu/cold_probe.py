"""The child side of bench/gpu/cold_compile.py: one arm in one process with empty caches (the
arms, torch's compile timers folded into phases, the target and flex probes, the steady-state
and captured timings). ``python -m bench.gpu.cold_compile --child ARM`` runs :func:`child`; the
module docstring there says what each figure means.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
from torch._dynamo.utils import compilation_time_metrics, counters, get_compilation_metrics
from torch.nn.attention.flex_attention import flex_attention
from transformers import Qwen3Config

from dflash import settings
from dflash.artifacts.manifest import atomic_write_json, file_lock
from dflash.models.drafter import head_dim_of
from dflash.models.features import FeatureExtractor
from dflash.models.masks import document_block_mask, document_dense_mask
from dflash.models.target import hf_config, load_target
from dflash.models.target_graph import CapturedFeatures
from dflash.runtime.gate import get_gate
from dflash.runtime.tracing import worker_thread_setup
from dflash.spec.load import section_spec
from dflash.train.warm import synthetic_row

ROOT = Path(__file__).resolve().parents[2]
# the arm's own switches: the parent clears them, the child records them
ENV_KEYS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS",
            "DFLASH_FLEX_KERNEL_OPTIONS", "TORCH_TRACE")

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
    "today": Arm("today's code path: compiled layer graph (flex inline), the BlockMask built "
                 "from the documents' boundaries (no mask graph), torch's default "
                 "compile_threads"),
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
                 "flex_options": fx.flex_options}

    def mask(d=di):  # the mask exactly as FeatureExtractor._run builds it
        return document_block_mask(d) if a.attention == "flex" else document_dense_mask(d)

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

