"""The warmup stage: compile every shape bucket on every drafter device once, and record it.

Builds the drafter exactly as training does (dflash.train.workers), then, on each drafter device in
turn, runs forward + backward + optimizer step for every bucket through the compile gate; on the
target devices it compiles the feature extractor per bucket on a one-layer copy of the target
(no weights needed): its decoder layers (``target.compile``) and, on CUDA, its flex attention. The
manifest lists every (callable, device, bucket) with its seconds, the compile cache directory
(one per env fingerprint) and the env and shape fingerprints that training checks.
"""
from __future__ import annotations

import contextlib
import threading
import time

from ..artifacts.cache import compile_cache_dir
from ..artifacts.manifest import write_manifest
from ..models.drafter import DFlashConfig
from ..models.dtypes import dtype_of
from ..runtime.clock import PhaseClock
from ..runtime.device_memory import peak_device_memory
from ..runtime.gate import get_gate
from ..train.warm import warm_all, warm_target_features
from ..train.workers import buckets, initial_state, make_replicas
from . import StageContext


@contextlib.contextmanager
def heartbeat(line, every_s: float = 15.0):
    """Print ``line(seconds so far)`` every ``every_s`` while the block runs (a compile is
    silent for up to a minute; the user sees it is alive)."""
    stop, t0 = threading.Event(), time.perf_counter()

    def beat():
        while not stop.wait(every_s):
            print(line(time.perf_counter() - t0), flush=True)

    th = threading.Thread(target=beat, name="warmup-heartbeat", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def run(ctx: StageContext) -> dict:
    spec = ctx.spec
    cache = compile_cache_dir(ctx.env_fingerprint)
    clock = PhaseClock()
    cfg = DFlashConfig.of_spec(spec)
    feat_width = len(cfg.target_layer_ids) * cfg.hidden_size
    replicas = make_replicas(spec, cfg, initial_state(cfg, spec.seed), total_steps=1000)
    # where the stage's seconds go, not only its compiles': the 8B warm-up spent ~61 s of its
    # 126 s cold (and of 67 s warm) outside any compile (bench/results/h200/round7-2026-12-02)
    clock.end("replicas")

    done: list[dict] = []

    def log(rec: dict) -> None:
        done.append(rec)
        who = f"replica {rec['replica']}" if "replica" in rec else "target"
        n = sum("replica" in r for r in done)
        tail = f" ({n}/{expected} drafter compiles done)" if "replica" in rec else ""
        print(f"[warmup] compiled {rec['callable']} on {rec['device']} ({who}) "
              f"bucket {rec['bucket']}: {rec['seconds']:.1f}s{tail}", flush=True)

    expected = len(replicas) * len(buckets(spec))
    print(f"[warmup] compiling the target's feature extractor where it compiles, then "
          f"{expected} drafter step(s): {len(replicas)} replica(s) on "
          f"{', '.join(spec.topology.drafters)} × bucket(s) {buckets(spec)} "
          f"(backend {spec.compile.backend})", flush=True)
    # the target feature extractor's compiled parts per (target device, bucket), on a one-layer
    # copy; first, as in training (loading a model registers its pytree node types)
    with heartbeat(lambda s: f"[warmup] still compiling ({s:.0f}s in; "
                             f"{sum('replica' in r for r in done)}/{expected} drafter compiles "
                             f"done)"):
        records = warm_target_features(spec, buckets(spec), log=log)
        clock.end("target")
        records += warm_all(replicas, buckets(spec), feat_width, dtype_of(spec.target.dtype),
                            optimizer_step=True, log=log)
        clock.end("drafters")
    total = clock.elapsed()
    per_device: dict[str, float] = {}
    for r in records:
        key = f"{r['device']}#{r.get('replica', 'target')}"
        per_device[key] = round(per_device.get(key, 0.0) + r["seconds"], 3)
    manifest = write_manifest(
        ctx.results / "warmup" / "manifest.json", "warmup",
        fingerprints={"env": ctx.env_fingerprint, "shape": spec.fingerprint("warmup")},
        compiled=records, buckets=buckets(spec), compile_cache=str(cache),
        seconds_total=round(total, 3), seconds_per_device=per_device,
        seconds_by_phase=clock.seconds,
        drafter_config=cfg.to_dict(), feature_width=feat_width,
        gate=get_gate().stats().summary(),
        peak_device_memory=peak_device_memory(spec.devices()),
        env_drift_overridden=ctx.drift, shared_with=ctx.shared_with)
    print(f"[warmup] done: {len(records)} (device, bucket) compiles in {total:.1f}s; "
          f"cache {cache}", flush=True)
    return manifest
