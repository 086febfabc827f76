"""The train stage: warm start, race-free threaded training, checkpoints, export, manifest.

``dflash train specs/<name>.yaml`` → results/<name>/train/{manifest.json, metrics.jsonl,
status.json, checkpoints/, drafter/}. A killed run started again resumes from the newest good
checkpoint (Snakemake keeps the checkpoints: they are not declared outputs).

:func:`train` reads top to bottom as its phases: prepare (verify inputs, plan steps, build
replicas) → resume → warm start → train steps → check replicas → export → manifest.

With ``topology.nodes`` > 1 the stage runs once per node under torchrun (:mod:`dflash.runtime.launch`
starts it; :mod:`dflash.runtime.distributed` joins the ranks): every rank trains its share of each
epoch, rank 0 alone writes metrics, status, checkpoints, the drafter and the manifest, and the
outputs have the same shape as a one-node run's.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..train import checkpoint as ckpt
from ..manifest import atomic_write_text, expect, read_manifest, write_manifest
from ..cache import compile_cache_dir
from ..code_fingerprint import stage_code_fingerprint
from . import StageContext


def total_steps_for(spec, step_map) -> int:
    """One step trains one batch on every drafter replica."""
    o = spec.optim
    return o.max_steps if o.max_steps is not None else step_map.total_for_epochs(o.epochs)


def verify_warmup(ctx: StageContext) -> dict:
    path = ctx.results / "warmup" / "manifest.json"
    m = read_manifest(path, "warmup")
    expect(m, path, {"env": ctx.env_fingerprint, "shape": ctx.spec.fingerprint("warmup")})
    return m


def injected_failures(rank: int | None = None) -> dict[str, int]:
    """Test hook: DFLASH_FAIL_AT="drafter-0:3,target-0:5" makes that worker raise at that step
    (failure-propagation and rerun-after-failure tests use it on the real stage);
    "drafter-0:3@1": on rank 1 only (topology.nodes > 1)."""
    out = {}
    for part in filter(None, os.environ.get("DFLASH_FAIL_AT", "").split(",")):
        part, _, on_rank = part.partition("@")
        if on_rank and int(on_rank) != (rank or 0):
            continue
        name, _, step = part.partition(":")
        out[name.strip()] = int(step)
    return out


class EpochLedger:
    """Which sample ids every epoch of the run trained on, across resumes.

    Its state travels in every checkpoint, so a resumed run proves exactly-once over the whole
    run, like an uninterrupted one. An epoch still running keeps its ids; once a later epoch
    starts, a finished one keeps only its verdict (a checkpoint stays small).
    """

    def __init__(self, all_ids, state: dict | None = None):
        self.all_ids = sorted(all_ids)
        self.epochs: dict[int, dict] = {int(e): dict(v) for e, v in (state or {}).items()}

    def add(self, epoch: int, ids: list[int]) -> None:
        for e, v in self.epochs.items():
            if e < epoch and "ids" in v:
                self.epochs[e] = self._verdict(v["ids"])
        self.epochs.setdefault(epoch, {"ids": []})["ids"].extend(ids)

    def _verdict(self, ids: list[int]) -> dict:
        # an epoch cut short by max_steps is not exactly-once, but it is not a bug either:
        # "duplicates" 0 with "complete" false says so at a glance
        distinct = len(set(ids))
        return {"samples": len(ids), "distinct": distinct, "duplicates": len(ids) - distinct,
                "complete": distinct == len(self.all_ids),
                "exactly_once": sorted(ids) == self.all_ids}

    def state(self) -> dict:
        return {str(e): {k: (list(x) if isinstance(x, list) else x) for k, x in v.items()}
                for e, v in sorted(self.epochs.items())}

    def report(self) -> dict:
        """Per epoch: samples trained on, distinct ids, and whether each id came exactly once
        (an epoch cut short by ``max_steps`` is not exactly-once)."""
        return {str(e): self._verdict(v["ids"]) if "ids" in v else dict(v)
                for e, v in sorted(self.epochs.items())}


class MetricsLog:
    """metrics.jsonl, one line per step; on resume, lines from steps not yet reached are cut."""

    def __init__(self, path: Path, start_step: int):
        self.path = path
        lines = []
        if path.exists() and start_step > 0:
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < start_step:
                        lines.append(line)
                except (ValueError, KeyError):
                    break  # a torn last line from a kill: drop it and the rest
        # atomic: a kill during this rewrite must not lose the lines of steps already done
        atomic_write_text(path, "".join(x + "\n" for x in lines))
        self.f = open(path, "a", buffering=1)

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self.f.close()


@dataclass
class Job:
    """What training needs, made once by :func:`prepare` and read by every later phase."""
    ctx: StageContext
    out: Path
    persist: bool            # checkpoints, resume and export (the bench's timed run: none)
    warmup: dict             # the verified warmup manifest
    compile_cache: Path
    ds: Any                  # dflash.data.dataset.TokenDataset
    bucket_lens: list[int]
    step_map: Any            # dflash.train.scheduler.StepMap
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


def run(ctx: StageContext) -> dict:
    """The train stage: results/<spec>/train/{manifest.json, metrics.jsonl, status.json,
    checkpoints/, drafter/}; resumes from the newest good checkpoint of the same run."""
    from ..runtime import distributed

    comm = distributed.init(ctx.spec.topology.drafters[0])
    if comm is None:
        return train(ctx, ctx.results / "train", persist=True, fail_at=injected_failures())
    return run_rank(ctx, comm)


def run_rank(ctx: StageContext, comm) -> dict:
    """One node's process of a multi-node run. Whatever fails, every rank exits promptly with
    one message naming the rank (and host) at fault; a finished run leaves the group together."""
    from ..runtime.distributed import HEARTBEAT_S, STALE_S, PeerFailed
    from ..errors import DFlashError

    try:
        manifest = train(ctx, ctx.results / "train", persist=True,
                         fail_at=injected_failures(comm.rank), comm=comm)
        comm.close()
        return manifest
    except BaseException as e:  # noqa: BLE001 - reported below, then this process exits
        verdict = comm.watchdog.verdict
        if verdict is None and _looks_like_lost_peer(e):
            # a collective failed because a peer vanished: the watchdog names which one
            deadline = time.monotonic() + STALE_S + 3
            while comm.watchdog.verdict is None and time.monotonic() < deadline:
                time.sleep(0.2)
            verdict = comm.watchdog.verdict
        if verdict is not None:
            msg, code = verdict, PeerFailed.exit_code
        else:
            msg = f"{comm.name()} failed: {e}" if isinstance(e, DFlashError) else \
                f"{comm.name()} failed: {type(e).__name__}: {e}"
            code = getattr(e, "exit_code", 1)
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            comm.watchdog.report_failure(first)
            if not isinstance(e, DFlashError) or e.__cause__ is not None:
                import traceback

                traceback.print_exception(e, file=sys.stderr)
            # let the other ranks read the record and stop with this rank's error named
            # before torchrun notices this exit and terminates them
            time.sleep(3 * HEARTBEAT_S)
        comm.watchdog.stop()
        print(f"error: {msg}", file=sys.stderr)
        print("what to do: fix the cause above if any, then rerun the same command; training "
              "resumes from the last checkpoint", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # no interpreter shutdown: a thread may still wait in a collective for the dead peer
        os._exit(code)


def _looks_like_lost_peer(e: BaseException) -> bool:
    text = ""
    while e is not None:
        text += f" {type(e).__name__}: {e}"
        e = e.__cause__ or e.__context__
    return any(k in text for k in ("Connection closed", "Connection reset", "Broken pipe",
                                   "gloo", "NCCL", "DistBackendError", "timed out",
                                   "Socket", "ECONNRESET"))


def timed_run(ctx: StageContext, out: Path, steps: int) -> dict:
    """The bench stage's timed run: a fresh run of ``steps`` steps in ``out``; no checkpoints,
    no resume, no export."""
    return train(ctx, out, persist=False, max_steps=steps, fail_at=injected_failures())


def train(ctx: StageContext, out: Path, persist: bool, max_steps: int | None = None,
          fail_at: dict | None = None, comm=None) -> dict:
    t_start = time.perf_counter()
    job = prepare(ctx, out, persist, max_steps, comm)
    progress = resume(job)
    targets, warm_start_s, warm_records = warm_start(job)
    trained = train_steps(job, progress, targets, fail_at or {})
    replicas_identical = check_replicas(job)
    across = check_ranks(job, trained.pipe)
    if persist and job.main:
        export(job)
    if not job.main:
        return {}
    return write_train_manifest(job, progress, trained, warm_start_s, warm_records,
                                replicas_identical, time.perf_counter() - t_start, across)


def prepare(ctx: StageContext, out: Path, persist: bool, max_steps: int | None,
            comm=None) -> Job:
    """Verify the inputs (warmup manifest, dataset), plan the steps, build the replicas."""
    from ..data.dataset import load_dataset
    from ..train.packing import plan_epoch
    from ..train.scheduler import StepMap
    from ..train.workers import buckets, drafter_config, initial_state, make_replicas

    spec = ctx.spec
    warm = verify_warmup(ctx)
    cache = compile_cache_dir(ctx.env_fingerprint)
    ds = load_dataset(spec, ctx.results)
    out.mkdir(parents=True, exist_ok=True)
    b = spec.batching

    def epoch_batches(epoch: int) -> list[list[int]]:
        return plan_epoch(ds.lengths, b.token_budget, b.max_batch_size, spec.seed, epoch)

    if comm is not None and comm.world != spec.topology.nodes:
        from ..errors import SpecError

        raise SpecError(f"{spec.path}: field 'topology.nodes': the spec asks for "
                        f"{spec.topology.nodes} nodes but torchrun started {comm.world} "
                        f"processes")
    ranks, rank = (comm.world, comm.rank) if comm is not None else (1, 0)
    # every rank plans the same epochs (seeded) and takes its own share of the batches
    step_map = StepMap(epoch_batches, len(spec.topology.drafters), ranks, rank)
    total_steps = max_steps if max_steps is not None else total_steps_for(spec, step_map)
    cfg = drafter_config(spec)
    replicas = make_replicas(spec, cfg, initial_state(cfg, spec.seed), total_steps)
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
    from ..runtime.gate import get_gate
    from ..spec import dtype_of
    from ..train.workers import make_target_workers
    from ..train.warm import warm_all, warm_targets

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


def train_steps(job: Job, progress: Progress, targets: list, fail_at: dict) -> Trained:
    """The threaded pipeline from ``progress.start_step`` to the last step: every step logged
    to metrics.jsonl and status.json, a checkpoint every ``checkpoint.every_steps``, simulated τ
    on held-out prompts every ``monitor.tau_every_steps`` (off by default; never in the bench
    stage's timed run)."""
    from ..train.packing import bucket_for, pack_row
    from ..train.scheduler import Pipeline
    from ..runtime.status import StatusReporter

    spec, ds, out = job.ctx.spec, job.ds, job.out
    counters = progress.counters
    # rank 0 writes; the other ranks keep the same books (every rank sees the whole step)
    metrics = MetricsLog(out / "metrics.jsonl", progress.start_step) if job.main else None
    status = StatusReporter(out / "status.json" if job.main else None, spec, job.total_steps)
    ledger = EpochLedger(ds.sample_ids, progress.epochs_seen)
    every = spec.checkpoint.every_steps
    every_tau = spec.monitor.tau_every_steps if job.persist and job.main else None
    monitor = None
    if every_tau:
        from ..eval.tau import TauMonitor

        monitor = TauMonitor(spec, job.ctx.results, job.replicas[0].device)
    pad_id = 0

    def make_row(batch: list[int]):
        return pack_row([ds.sample(i) for i in batch],
                        bucket_for(sum(ds.lengths[i] for i in batch), job.bucket_lens), pad_id)

    def on_step(rec) -> None:
        counters["tokens"] += rec.tokens
        counters["samples"] += len(rec.sample_ids)
        ledger.add(rec.epoch, rec.sample_ids)
        extra = {}
        if monitor is not None and ((rec.step + 1) % every_tau == 0
                                    or rec.step + 1 == job.total_steps):
            # on the first replica's thread, after its step: the others wait at the barrier
            m = monitor(job.replicas[0])
            extra = {"tau_heldout": m["tau"], "tau_seconds": m["seconds"]}
        if not job.main:
            return
        metrics.write({"step": rec.step, "epoch": rec.epoch, "loss": rec.loss, "lr": rec.lr,
                       "grad_norm": rec.grad_norm, "tokens": rec.tokens,
                       "labelled": rec.labelled, "samples": len(rec.sample_ids),
                       "draft_acc": rec.draft_acc,
                       "sample_ids": rec.sample_ids, "t": round(rec.t_end - t0, 4), **extra})
        status.step(rec)
        if job.persist and ((rec.step + 1) % every == 0 or rec.step + 1 == job.total_steps):
            # every rank has reached this step (the step's record was gathered from all)
            ckpt.save(out / "checkpoints", rec.step + 1, job.replicas[0], dict(counters),
                      spec.checkpoint.keep, job.run_fingerprint, ledger.state(),
                      nodes=spec.topology.nodes)

    t0 = time.perf_counter()
    pipe = Pipeline(target_workers=targets, replicas=job.replicas, step_map=job.step_map,
                    make_row=make_row, start_step=progress.start_step,
                    total_steps=job.total_steps, seed=spec.seed,
                    mask_token_id=job.cfg.mask_token_id,
                    queue_depth=spec.topology.queue_depth, on_step=on_step,
                    fail_at=fail_at, comm=job.comm)
    if job.comm is not None:
        from ..runtime.distributed import PeerFailed

        job.comm.watchdog.on_failure(
            lambda msg: pipe._fail("watchdog", job.comm.name(), PeerFailed(msg)))
    try:
        pipe.run(on_tick=status.tick if job.main else None, tick_s=5.0)
    finally:
        if metrics is not None:
            metrics.close()
    return Trained(pipe=pipe, status=status, ledger=ledger, seconds=time.perf_counter() - t0)


def check_replicas(job: Job) -> bool:
    """Every replica holds the same weights (data parallel, identical updates)."""
    ref = job.replicas[0].model.state_dict()
    return all(torch.equal(ref[k].cpu(), r.model.state_dict()[k].cpu())
               for r in job.replicas[1:] for k in ref)


def check_ranks(job: Job, pipe) -> dict | None:
    """Across nodes: every rank's replica-0 weights, hashed, gathered in rank order."""
    if job.comm is None:
        return None
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(job.replicas[0].model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    d = job.comm
    local = {"rank": d.rank, "host": d.host, "weights_sha256": h.hexdigest(),
             "allreduce_s": allreduce_seconds(pipe)}
    return {"ranks": d.all_gather(local), "backend": d.backend}


def allreduce_seconds(pipe) -> dict:
    """This rank's time in the cross-node all-reduce (from the local sum being ready to the
    global sum being there: transfer plus waiting for the slowest rank)."""
    seconds = pipe.allreduce.collect(block=True) if pipe.allreduce is not None else 0.0
    steps = max(1, pipe.steps_done - pipe.start_step)
    return {"total": round(seconds, 4), "per_step_mean": seconds / steps}


def export(job: Job) -> Path:
    """The HF drafter folder (reference parameter names), complete or not at all."""
    from ..models.drafter import export_drafter

    export_dir, tmp = job.out / "drafter", job.out / ".drafter.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    export_drafter(job.replicas[0].model, job.cfg, tmp)
    shutil.rmtree(export_dir, ignore_errors=True)
    tmp.rename(export_dir)
    return export_dir


def _distributed_facts(job: Job, across: dict | None) -> dict:
    """nodes, the gradient bytes each all-reduce moves, per-rank weight hashes (equal: the
    replicas stayed identical across nodes) and all-reduce seconds per step."""
    if across is None:
        return {"nodes": 1}
    ranks = across["ranks"]
    n = sum(p.numel() for p in job.replicas[0].params)
    per_step = [r["allreduce_s"]["per_step_mean"] for r in ranks]
    return {"nodes": len(ranks), "backend": across["backend"],
            "hosts": [r["host"] for r in ranks],
            "allreduce_bytes_per_step": (n + 1) * 4,
            "allreduce_s_per_step_mean": sum(per_step) / len(per_step),
            "allreduce_s_per_step_by_rank": per_step,
            "weights_sha256_by_rank": [r["weights_sha256"] for r in ranks],
            "replicas_identical_across_ranks": len({r["weights_sha256"] for r in ranks}) == 1}


def write_train_manifest(job: Job, progress: Progress, trained: Trained, warm_start_s: float,
                         warm_records: list[dict], replicas_identical: bool,
                         wall_s: float, across: dict | None = None) -> dict:
    from ..models.drafter import export_checksums
    from ..runtime.gate import get_gate

    ctx, spec, pipe = job.ctx, job.ctx.spec, trained.pipe
    st = get_gate().stats()
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
        time_to_first_step_s=round(min((v for k, v in pipe.first_step_s.items()
                                        if k.startswith("drafter")), default=0.0)
                                   + warm_start_s, 3),
        first_step_s=pipe.first_step_s,
        gate={"enabled": st["enabled"], "compiles": st["compiles"]["count"],
              "recompiles_after_warmup": st["recompiles_after_warmup"]["count"],
              "recompile_sigs": [repr(s) for s in st["recompiles_after_warmup"]["sigs"]],
              "recompile_reasons": st["recompiles_after_warmup"]["reasons"],
              "race_errors": st["race_errors"]["count"], "race_by_class":
                  st["race_errors"]["by_class"], "shared_wait_s": st["shared_wait_s"],
              "exclusive_wait_s": st["exclusive_wait_s"],
              "exclusive_hold_s": st["exclusive_hold_s"]},
        busy_s={k: round(v, 3) for k, v in pipe.busy_s.items()},
        wait_s={k: round(v, 3) for k, v in pipe.wait_s.items()},
        wall_s=round(wall_s, 3), train_s=round(trained.seconds, 3),
        steady_state=trained.status.steady_state(),
        final_loss=pipe.last_record.loss if pipe.last_record else None,
        replicas=len(job.replicas), replicas_identical=replicas_identical,
        exactly_once=trained.ledger.report(),
        drafter_dir=str(job.out / "drafter"), env_drift_overridden=ctx.drift,
        # the export by content: bench (dflash.manifest.verify_files) and Snakemake check it
        files={f"drafter/{f}": sha for f, sha in export_checksums(job.out / "drafter").items()}
        if job.persist else {},
        topology=asdict(spec.topology), distributed=_distributed_facts(job, across))
    trained.status.done(manifest)
    print(f"[train] done: {steps_run} steps in {trained.seconds:.1f}s, final loss "
          f"{manifest['final_loss']}, recompiles after warmup "
          f"{manifest['gate']['recompiles_after_warmup']}, race errors "
          f"{manifest['gate']['race_errors']}", flush=True)
    return manifest
