"""A training run as its phases: the train stage's whole run and the bench stage's timed run.

:func:`train` reads top to bottom as its phases: prepare (verify inputs, plan steps, build
replicas) → resume → warm start → train steps → check replicas → export → manifest; it writes
``<out>/{manifest.json, metrics.jsonl, status.json, checkpoints/, drafter/}``. A killed run
started again resumes from the newest good checkpoint. :func:`timed_run` is the bench stage's
fresh run of N steps (no checkpoints, no resume, no export).

With ``topology.nodes`` > 1 it runs once per node under torchrun (:mod:`dflash.runtime.launch`
starts it; :mod:`dflash.runtime.distributed` joins and supervises the ranks): every rank trains
its share of each epoch, rank 0 alone writes metrics, status, checkpoints, the drafter and the
manifest, and the outputs have the same shape as a one-node run's.

Owns: the phases and the train manifest. Imports the top-level modules, models/, data/,
runtime/ and train/; the τ monitor (eval/, above this room) is handed in by the stage.
``ctx`` is the stage's :class:`dflash.stages.StageContext` (duck-typed: stages/ is above).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..artifacts.cache import compile_cache_dir
from ..artifacts.code_fingerprint import stage_code_fingerprint
from ..data.dataset import load_dataset
from ..errors import SpecError
from ..artifacts.manifest import expect, read_manifest, write_manifest
from ..models.drafter import DFlashConfig, export_checksums, export_drafter
from ..runtime import distributed
from ..runtime.distributed import PeerFailed
from ..runtime.device_memory import peak_device_memory
from ..runtime.faults import injected_failures
from ..runtime.gate import get_gate
from ..runtime.status import StatusReporter, by_role
from ..models.dtypes import dtype_of
from ..spec.types import cache_mode
from . import checkpoint as ckpt
from .tracker import open_tracker
from .books import EpochLedger, StepBooks
from .cache_budget import check_run
from .feature_cache import open_for_run
from .packing import bucket_for, pack_row, plan_epoch
from .packing import StepMap
from .profile import StepProfiler
from .scheduler import Pipeline
from .warm import warm_all, warm_targets
from .workers import (buckets, initial_state, make_replicas,
                      make_target_workers)

# the τ monitor's factory: (spec, results dir, device) -> a callable replica -> {"tau", ...}
MonitorFactory = Callable[[Any, Path, str], Callable]


def total_steps_for(spec, step_map) -> int:
    """One step trains one batch on every drafter replica."""
    o = spec.optim
    return o.max_steps if o.max_steps is not None else step_map.total_for_epochs(o.epochs)


def verify_warmup(ctx) -> dict:
    path = ctx.results / "warmup" / "manifest.json"
    m = read_manifest(path, "warmup")
    expect(m, path, {"env": ctx.env_fingerprint, "shape": ctx.spec.fingerprint("warmup")})
    return m


@dataclass
class Job:
    """What training needs, made once by :func:`prepare` and read by every later phase."""
    ctx: Any                 # dflash.stages.StageContext
    out: Path
    persist: bool            # checkpoints, resume and export (the bench's timed run: none)
    warmup: dict             # the verified warmup manifest
    compile_cache: Path
    ds: Any                  # dflash.data.dataset.TokenDataset
    bucket_lens: list[int]
    step_map: Any            # dflash.train.packing.StepMap
    total_steps: int
    cfg: Any                 # dflash.models.drafter.DFlashConfig
    replicas: list
    run_fingerprint: dict    # a checkpoint only resumes the run it came from
    comm: Any = None         # dflash.runtime.distributed.Dist (nodes > 1) or None

    @property
    def main(self) -> bool:
        """The rank that writes (rank 0; the only one with one node)."""
        return self.comm is None or self.comm.is_main


@dataclass
class Progress:
    """Where the run starts: from scratch, or the counters of the checkpoint it resumes."""
    start_step: int = 0
    counters: dict = field(default_factory=lambda: {"tokens": 0, "samples": 0})
    epochs_seen: dict | None = None


@dataclass
class Trained:
    pipe: Any                # dflash.train.scheduler.Pipeline, after its run
    status: Any              # dflash.runtime.status.StatusReporter
    ledger: EpochLedger
    seconds: float
    feature_cache: dict | None = None  # its counters, when features.cache is on


def timed_run(ctx, out: Path, steps: int) -> dict:
    """The bench stage's timed run: a fresh run of ``steps`` steps in ``out``; no checkpoints,
    no resume, no export."""
    return train(ctx, out, persist=False, max_steps=steps, fail_at=injected_failures())


def train(ctx, out: Path, persist: bool, max_steps: int | None = None,
          fail_at: dict | None = None, comm=None, monitor: MonitorFactory | None = None) -> dict:
    """The run, as its phases. ``monitor``: the τ monitor's factory (``monitor.tau_every_steps``;
    the train stage hands in :class:`dflash.eval.tau_monitor.TauMonitor`)."""
    t_start = time.perf_counter()
    job = prepare(ctx, out, persist, max_steps, comm)
    progress = resume(job)
    targets, warm_start_s, warm_records = warm_start(job)
    trained = train_steps(job, progress, targets, fail_at or {}, monitor)
    replicas_identical = check_replicas(job)
    across = check_ranks(job, trained.pipe)
    if persist and job.main:
        export(job)
    if not job.main:
        return {}
    return write_train_manifest(job, progress, trained, warm_start_s, warm_records,
                                replicas_identical, time.perf_counter() - t_start, across)


def prepare(ctx, out: Path, persist: bool, max_steps: int | None, comm=None) -> Job:
    """Verify the inputs (warmup manifest, dataset), plan the steps, build the replicas."""
    spec = ctx.spec
    warm = verify_warmup(ctx)
    cache = compile_cache_dir(ctx.env_fingerprint)
    ds = load_dataset(spec, ctx.results)
    out.mkdir(parents=True, exist_ok=True)
    b = spec.batching

    def epoch_batches(epoch: int) -> list[list[int]]:
        return plan_epoch(ds.lengths, b.token_budget, b.max_batch_size, spec.seed, epoch)

    if comm is not None and comm.world != spec.topology.nodes:
        raise SpecError(f"{spec.path}: field 'topology.nodes': the spec asks for "
                        f"{spec.topology.nodes} nodes but torchrun started {comm.world} "
                        f"processes")
    ranks, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    # every rank plans the same epochs (seeded) and takes its own share of the batches
    step_map = StepMap(epoch_batches, len(spec.topology.drafters), ranks, rank)
    total_steps = max_steps if max_steps is not None else total_steps_for(spec, step_map)
    cfg = DFlashConfig.of_spec(spec)
    check_run(spec, ds, out, cfg)  # refuses a feature cache that does not fit, before heavy work
    replicas = make_replicas(spec, cfg, initial_state(cfg, spec.seed, spec), total_steps)
    # the train code too: a checkpoint of other code is not resumed (its run is not this one)
    run_fp = {"train": spec.fingerprint("train"), "shape": spec.fingerprint("warmup"),
              "dataset_sha256": ds.manifest["dataset"]["sha256"],
              "code": stage_code_fingerprint("train")}
    return Job(ctx=ctx, out=out, persist=persist, warmup=warm, compile_cache=cache, ds=ds,
               bucket_lens=buckets(spec), step_map=step_map, total_steps=total_steps, cfg=cfg,
               replicas=replicas, run_fingerprint=run_fp, comm=comm)


def resume(job: Job) -> Progress:
    """Load the checkpoint :func:`dflash.train.checkpoint.resume_point` picks into every
    replica (weights, optimizer, schedule) and return its counters."""
    found = None
    if job.persist:
        found = ckpt.resume_point(job.out / "checkpoints", job.run_fingerprint, job.total_steps,
                                  job.ctx.spec.topology.nodes, job.ctx.spec.path, job.comm,
                                  log=lambda m: print(m, flush=True))
    if found is None:
        return Progress()
    path, state = found
    ckpt.load_into(path, state, job.replicas)
    if job.main:
        print(f"[train] resuming from {path} (step {state['step']}/{job.total_steps})",
              flush=True)
    return Progress(start_step=state["step"], counters=state["counters"],
                    epochs_seen=state.get("epochs_seen"))


def warm_start(job: Job) -> tuple[list, float, list[dict]]:
    """Every (worker, bucket) compiles once under the exclusive gate (fast: the warmup stage
    filled the compile cache); then the gate refuses and counts recompiles."""
    spec, cfg = job.ctx.spec, job.cfg
    t0 = time.perf_counter()
    feat_width = len(cfg.target_layer_ids) * cfg.hidden_size
    # targets first: loading a model imports its modeling module, which registers pytree node
    # types; a drafter graph compiled before that fails its pytree guard on the first real step
    # (measured on H200: "len(torch.utils._pytree.SUPPORTED_NODES) != 102")
    targets = make_target_workers(spec)
    records = warm_targets(targets, job.bucket_lens, cfg.vocab_size)
    records += warm_all(job.replicas, job.bucket_lens, feat_width,
                        dtype_of(spec.target.dtype), optimizer_step=False)
    get_gate().mark_warm()
    seconds = time.perf_counter() - t0
    print(f"[train] warm start: {len(records)} (worker, bucket) steps in "
          f"{seconds:.1f}s; gate now refuses recompiles", flush=True)
    return targets, seconds, records


def train_steps(job: Job, progress: Progress, targets: list, fail_at: dict,
                monitor: MonitorFactory | None = None) -> Trained:
    """The threaded pipeline from ``progress.start_step`` to the last step, its per-step work
    in the books (:class:`dflash.train.books.StepBooks`): every step logged to metrics.jsonl
    and status.json, a checkpoint every ``checkpoint.every_steps``, simulated τ on held-out
    prompts every ``monitor.tau_every_steps`` (off by default; never in the bench stage's timed
    run)."""
    spec, ds = job.ctx.spec, job.ds
    # rank 0 writes; the other ranks keep the same books (every rank sees the whole step)
    status = StatusReporter(job.out / "status.json" if job.main else None, spec,
                            job.total_steps)
    every_tau = spec.monitor.tau_every_steps if job.persist and job.main else None
    tau = monitor(spec, job.ctx.results, job.replicas[0].device) \
        if every_tau and monitor is not None else None
    books = StepBooks(job.out, start_step=progress.start_step, counters=progress.counters,
                      ledger=EpochLedger(ds.sample_ids, progress.epochs_seen), status=status,
                      checkpoint=spec.checkpoint, nodes=spec.topology.nodes,
                      total_steps=job.total_steps, replica=job.replicas[0],
                      run_fingerprint=job.run_fingerprint, writer=job.main,
                      persist=job.persist, monitor=tau, tau_every=every_tau,
                      tracker=open_tracker(spec, job.out, progress.start_step)
                      if job.persist and job.main else None)
    cache = open_for_run(spec, ds, job.out, job.cfg, job.step_map, progress.start_step,
                         job.total_steps, job.run_fingerprint)
    books.feature_cache = cache
    pad_id = 0

    def make_row(batch: list[int]):
        return pack_row([ds.sample(i) for i in batch],
                        bucket_for(sum(ds.lengths[i] for i in batch), job.bucket_lens), pad_id)

    profiler = open_profiler(job, progress)
    books.start()
    pipe = Pipeline(target_workers=targets, replicas=job.replicas, step_map=job.step_map,
                    make_row=make_row, start_step=progress.start_step,
                    total_steps=job.total_steps, seed=spec.seed,
                    queue_depth=spec.topology.queue_depth, on_step=books.record,
                    fail_at=fail_at, comm=job.comm, feature_cache=cache, profiler=profiler,
                    stall_s=spec.monitor.stall_s, sync_at=books.state_due)
    if job.comm is not None:
        job.comm.watchdog.on_failure(
            lambda msg: pipe.fail("watchdog", job.comm.name(), PeerFailed(msg)))
    try:
        pipe.run(on_tick=status.tick if job.main else None, tick_s=5.0)
        books.finish()
    finally:
        books.close()
        if profiler is not None:
            profiler.stop(pipe)  # a failed run's open window: closed, not written
        if cache is not None:  # a completed run deletes a disk cache; a failed one keeps it
            cache.close(remove=pipe.steps_done >= job.total_steps and pipe.error is None)
    if profiler is not None:
        summary = profiler.write(job.out / "profile.json")
        print(f"[train] profile: {summary['steps']} steps from step {summary['first_step']} "
              f"(epochs {summary.get('epochs')}) -> {job.out / 'profile.json'}", flush=True)
    return Trained(pipe=pipe, status=status, ledger=books.ledger,
                   seconds=time.perf_counter() - books.t0,
                   feature_cache=dict(cache.stats, mode=cache_mode(spec),
                                      dtype=spec.features.dtype) if cache else None)


def open_profiler(job: Job, progress: Progress) -> StepProfiler | None:
    """``monitor.profile_steps``: the train stage's profiler (rank 0; never the bench stage's
    timed run), or None; a profile.json of an earlier run is removed either way (a rerun with
    the switch off must not leave another run's figures beside its manifest)."""
    n = job.ctx.spec.monitor.profile_steps
    if job.main:
        (job.out / "profile.json").unlink(missing_ok=True)
    if not (n and job.persist and job.main) or progress.start_step >= job.total_steps:
        return None
    return StepProfiler(n, progress.start_step, job.total_steps, job.ctx.spec.devices(),
                        at=job.ctx.spec.monitor.profile_start)


def check_replicas(job: Job) -> bool:
    """Every replica holds the same weights (data parallel, identical updates)."""
    ref = job.replicas[0].model.state_dict()
    return all(torch.equal(ref[k].cpu(), r.model.state_dict()[k].cpu())
               for r in job.replicas[1:] for k in ref)


def check_ranks(job: Job, pipe) -> dict:
    """Across nodes: every rank's replica-0 weights (hashed), host and all-reduce seconds,
    gathered in rank order (:func:`dflash.runtime.distributed.rank_report`)."""
    if job.comm is None:
        return {"nodes": 1}
    seconds = pipe.allreduce.collect(block=True) if pipe.allreduce is not None else 0.0
    return distributed.rank_report(job.comm, job.replicas[0].model.state_dict(), seconds,
                                   pipe.steps_done - pipe.start_step,
                                   sum(p.numel() for p in job.replicas[0].params))


def export(job: Job) -> Path:
    """The HF drafter folder (reference parameter names), complete or not at all."""
    export_dir, tmp = job.out / "drafter", job.out / ".drafter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_drafter(job.replicas[0].model, job.cfg, tmp)
    shutil.rmtree(export_dir, ignore_errors=True)
    tmp.rename(export_dir)
    return export_dir


def write_train_manifest(job: Job, progress: Progress, trained: Trained, warm_start_s: float,
                         warm_records: list[dict], replicas_identical: bool,
                         wall_s: float, across: dict | None = None) -> dict:
    ctx, spec, pipe = job.ctx, job.ctx.spec, trained.pipe
    steps_run = job.total_steps - progress.start_step
    manifest = write_manifest(
        job.out / "manifest.json", "train",
        fingerprints={"env": ctx.env_fingerprint, "shape": spec.fingerprint("warmup"),
                      "train": spec.fingerprint("train"),
                      "data": job.ds.manifest["fingerprints"]["data"],
                      "dataset_sha256": job.ds.manifest["dataset"]["sha256"],
                      "warmup": job.warmup["checksum"]},
        steps={"total": job.total_steps, "run_now": steps_run,
               "resumed_from": progress.start_step, "epoch_starts": job.step_map.starts},
        counters=progress.counters, compile_cache=str(job.compile_cache),
        warm_start={"seconds": round(warm_start_s, 3), "records": warm_records},
        # the first *training* step: the drafter replicas' first optimizer step (replicas step
        # together; target workers finish their first forward earlier)
        time_to_first_step_s=round(min(by_role(pipe.first_step_s, "drafter").values(),
                                       default=0.0)
                                   + warm_start_s, 3),
        first_step_s=pipe.first_step_s,
        gate=get_gate().stats().summary(),
        busy_s={k: round(v, 3) for k, v in pipe.busy_s.items()},
        wait_s={k: round(v, 3) for k, v in pipe.wait_s.items()},
        wall_s=round(wall_s, 3), train_s=round(trained.seconds, 3),
        steady_state=trained.status.steady_state(),
        final_loss=pipe.last_record.loss if pipe.last_record else None,
        replicas=len(job.replicas), replicas_identical=replicas_identical,
        exactly_once=trained.ledger.report(),
        drafter_dir=str(job.out / "drafter"), env_drift_overridden=ctx.drift,
        # the export by content: bench (dflash.artifacts.manifest.verify_files) and Snakemake check it
        files={f"drafter/{f}": sha for f, sha in export_checksums(job.out / "drafter").items()}
        if job.persist else {},
        topology=asdict(spec.topology), distributed=across or {"nodes": 1},
        feature_cache=trained.feature_cache,
        peak_device_memory=peak_device_memory(spec.devices()))
    trained.status.done(manifest)
    print(f"[train] done: {steps_run} steps in {trained.seconds:.1f}s, final loss "
          f"{manifest['final_loss']}, recompiles after warmup "
          f"{manifest['gate']['recompiles_after_warmup']}, race errors "
          f"{manifest['gate']['race_errors']}", flush=True)
    return manifest
