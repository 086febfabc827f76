"""The decoders stage: the bench stage's decoding sweep compiled ahead, beside the data stage.

The sweep (``bench.decode_batches`` × target-only, the full block and each of
``bench.decode_widths``; HF static generate at batch 1) took 274 s of round 17's 411 s bench
stage on an H200, nine tenths of it compiling its 16 decoders
(``bench/results/h200/round17-2026-12-04/``), at the end of the DAG where nothing runs beside
it. Nothing a decoder compiles depends on the drafter's weights, only on shapes: the target, the
drafter's config, the primary eval set's prompts, the batch sizes and widths. So this stage
builds the same decoders (:func:`dflash.eval.serving.compile_ahead`, from the same
:func:`~dflash.eval.serving.sweep_arguments` the bench uses) with a random drafter of the spec's
shape, compiles, captures and decodes each once, into the env's compile cache
(:func:`dflash.artifacts.cache.compile_cache_dir`), while the data stage generates and the
warm-up compiles; the bench stage then loads their kernels. The manifest records each decoder's
seconds (the bench report's ``decode_speed`` shows what its own compiles then took).

The batch sizes compile in parallel, each in a process of its own (:func:`worker_count` of
them at once, spawned: no compile of one process can race another's): round 27 on an H100 took
338 s one decoder at a time, 106 s past the data stage, and training, which holds the GPU
whole, waited for it (bench/results/h100/round27-2026-12-06/README.md); round 28's three
processes took 236 s and ended 16 s before the data stage
(bench/results/h100/round28-2026-12-06/README.md).

A failure while compiling is recorded (``failed`` in the manifest, the traceback in
``decoders/error.txt``), not raised: the stage only saves the bench time, so the bench still
runs and compiles its decoders itself. A spec has this stage only where the bench compiles a
sweep: :func:`dflash.spec.types.no_decoders_stage`
says why not otherwise (run by hand there, the stage records that reason and compiles nothing).
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from ..artifacts.cache import compile_cache_dir
from ..artifacts.manifest import write_manifest
from ..decode.generate import eos_ids_of
from ..eval.evalsets import load_eval_sets
from ..eval.serving import HF_BATCHES, compile_ahead, sweep_arguments
from ..models.drafter import DFlashConfig, DFlashDrafter
from ..models.dtypes import dtype_of
from ..models.target import load_target, target_embeddings
from ..runtime.clock import PhaseClock
from ..runtime.device_memory import peak_device_memory
from ..runtime.resources import SHARE_AT_MOST, device_memory
from ..spec.types import no_decoders_stage
from ..train.budget import stage_memory
from . import StageContext, failure_line


NICENESS = 10  # os.nice increment: below the data stage and the warm-up on the host's CPUs
# processes compiling at once, at most: one per batch size of the default sweep (1, 4, 16, 64);
# each is a Python process tracing and lowering on one core, with inductor's compile workers
# for its kernels (round 27's H100 host: 16 cores, beside the data stage and the warm-up)
MAX_WORKERS = 4


def random_drafter(spec, device: str) -> DFlashDrafter:
    """A drafter of the spec's shape as the bench stage loads the trained one
    (:func:`dflash.models.drafter.load_drafter`): its config read back from the exported form,
    its weights random (seeded), in ``drafter.dtype`` on ``device``."""
    cfg = DFlashConfig.from_hf_dict(DFlashConfig.of_spec(spec).to_hf_dict())
    torch.manual_seed(spec.seed)
    model = DFlashDrafter(cfg).to(device=device, dtype=dtype_of(spec.drafter.dtype))
    return model.eval()


def worker_count(batches, one_bytes: int | None, device_bytes: int | None) -> int:
    """How many processes compile the sweep's batch sizes at once: one per batch size, at most
    :data:`MAX_WORKERS`, and no more than fit in the share of the device the scheduler counts
    the stage for (:data:`~dflash.runtime.resources.SHARE_AT_MOST` of its memory,
    ``one_bytes`` each: one process's estimate, :func:`dflash.train.budget.stage_memory`); one
    where either figure is unknown or one process alone is larger than that share."""
    if not one_bytes or not device_bytes:
        return 1
    return max(1, min(len(batches), MAX_WORKERS, int(SHARE_AT_MOST * device_bytes // one_bytes)))


def compile_batch(spec, env_fingerprint: str, batch: int) -> dict:
    """One worker's part (in a process of its own): the target, a random drafter of the spec's
    shape and the primary eval set's prompts loaded as the bench loads them, then the sweep's
    decoders at ``batch`` compiled into the env's compile cache. Its records and its peak."""
    b, device = spec.bench, spec.topology.targets[0]
    compile_cache_dir(env_fingerprint)
    tgt = load_target(spec.target, device, seed=spec.seed)
    drafter = random_drafter(spec, device)
    embed, head = target_embeddings(spec.target, spec.seed)
    first = load_eval_sets(spec, None, tgt.tokenizer, b.eval_sets[:1], b.eval_prompts)[0]
    args = sweep_arguments(b, tgt.tokenizer, first.prompts, eos_ids_of(tgt), embed, head)
    rows = compile_ahead(tgt.model, drafter, **{**args, "batches": [batch]})
    return {"rows": rows, "peak": peak_device_memory([device]).get(device, 0)}


def compile_in_parallel(ctx: StageContext, workers: int) -> tuple[list[dict], str | None, int]:
    """Every batch size's decoders, ``workers`` processes at once (spawned: a fresh CUDA
    context and compiler state each), the costliest first: a batch size where the sweep times HF
    static generate (one more compile; round 28 on an H100 started batch 1 last, and its 115 s
    ended the stage), then the largest. A batch size that fails is recorded (the first
    failure) and the bench compiles it itself. (records in the sweep's order, the failure or
    None, the workers' summed peak device memory)"""
    batches = list(ctx.spec.bench.decode_batches)
    rows, failed, peak = {}, None, 0
    first = sorted(batches, key=lambda b: (b in HF_BATCHES, b), reverse=True)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        jobs = {pool.submit(compile_batch, ctx.spec, ctx.env_fingerprint, b): b for b in first}
        for job in as_completed(jobs):
            try:
                out = job.result()
            except Exception as e:  # noqa: BLE001 - recorded: the bench compiles these itself
                failed = failed or failure_line(e, ctx.results / "decoders" / "error.txt")
                continue
            rows[jobs[job]], peak = out["rows"], peak + out["peak"]
    return [r for b in batches for r in rows.get(b, [])], failed, peak


def run(ctx: StageContext) -> dict:
    """The stage as its phases: how many processes compile, then every decoder of the bench's
    sweep compiled ahead in them, then the manifest."""
    spec, b = ctx.spec, ctx.spec.bench
    cache = compile_cache_dir(ctx.env_fingerprint)
    clock, rows, failed, peak, workers = PhaseClock(), [], None, {}, 0
    skipped = no_decoders_stage(spec)
    if skipped is None:
        # beside the data stage, whose generation loop is on the DAG's critical path: this
        # stage's processes and their compile workers (inherited) yield the host's cores to it.
        # Training holds the GPU whole, so it waits for this stage too: past the data stage
        # this stage is on the critical path (one process, round 27 on an H100: 338 s, training
        # 106 s after the data; round 25's 369 s, 146 s after; three, round 28: 236 s, 16 s
        # before the data)
        os.nice(NICENESS)
        device = spec.topology.targets[0]
        workers = worker_count(b.decode_batches, stage_memory(spec)["decoders"].get(device),
                               device_memory([device]).get(device))
        clock.end("plan")
        print(f"[decoders] compiling the bench's decoding sweep ahead in {workers} "
              f"process(es): batch sizes {list(b.decode_batches)}, verify widths "
              f"{list(b.decode_widths)} beside the full block, on the first "
              f"{b.eval_sets[0]} prompts ({b.decode_shapes} shapes; cache {cache})", flush=True)
        rows, failed, summed = compile_in_parallel(ctx, workers)
        peak = {device: summed}  # the workers' peaks summed: a bound, as they overlap in time
        if failed:
            print(f"[decoders] warning: compiling ahead failed ({failed}); the bench stage "
                  f"compiles those decoders itself", flush=True)
        clock.end("compile")
    else:
        print(f"[decoders] nothing to compile ahead: {skipped}", flush=True)
    total = clock.elapsed()
    manifest = write_manifest(
        ctx.results / "decoders" / "manifest.json", "decoders",
        fingerprints={"env": ctx.env_fingerprint, "decoders": spec.fingerprint("decoders")},
        skipped=skipped, failed=failed, compiled=rows, compile_cache=str(cache),
        workers=workers, seconds_total=round(total, 3), seconds_by_phase=clock.seconds,
        peak_device_memory=peak,
        env_drift_overridden=ctx.drift)
    print(f"[decoders] done: {len(rows)} decoder(s) compiled ahead in {total:.1f}s", flush=True)
    return manifest
