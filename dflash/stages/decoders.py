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

A failure while compiling is recorded (``failed`` in the manifest, the traceback in
``decoders/error.txt``), not raised: the stage only saves the bench time, so the bench still
runs and compiles its decoders itself. A spec has this stage only where the bench compiles a
sweep: :func:`dflash.spec.types.no_decoders_stage`
says why not otherwise (run by hand there, the stage records that reason and compiles nothing).
"""
from __future__ import annotations

import os

import torch

from ..artifacts.cache import compile_cache_dir
from ..artifacts.manifest import write_manifest
from ..decode.generate import eos_ids_of
from ..eval.evalsets import load_eval_sets
from ..eval.serving import compile_ahead, sweep_arguments
from ..models.drafter import DFlashConfig, DFlashDrafter
from ..models.dtypes import dtype_of
from ..models.target import load_target, target_embeddings
from ..runtime.clock import PhaseClock
from ..runtime.device_memory import peak_device_memory
from ..runtime.gate import get_gate
from ..spec.types import no_decoders_stage
from . import StageContext, failure_line


NICENESS = 10  # os.nice increment: below the data stage and the warm-up on the host's CPUs


def random_drafter(spec, device: str) -> DFlashDrafter:
    """A drafter of the spec's shape as the bench stage loads the trained one
    (:func:`dflash.models.drafter.load_drafter`): its config read back from the exported form,
    its weights random (seeded), in ``drafter.dtype`` on ``device``."""
    cfg = DFlashConfig.from_hf_dict(DFlashConfig.of_spec(spec).to_hf_dict())
    torch.manual_seed(spec.seed)
    model = DFlashDrafter(cfg).to(device=device, dtype=dtype_of(spec.drafter.dtype))
    return model.eval()


def run(ctx: StageContext) -> dict:
    """The stage as its phases: the models and prompts the bench decodes with, then every
    decoder of its sweep compiled ahead, then the manifest."""
    spec, b = ctx.spec, ctx.spec.bench
    cache = compile_cache_dir(ctx.env_fingerprint)
    clock, rows, failed = PhaseClock(), [], None
    skipped = no_decoders_stage(spec)
    if skipped is None:
        # beside the data stage, whose generation loop is on the DAG's critical path: this
        # stage's compile workers (inherited) yield the host's cores to it. Training holds the
        # GPU whole, so it waits for this stage too: past the data stage this stage is on the
        # critical path (round 25 on an H100: 369 s of compile, training 146 s after the data;
        # round 24's 255 s, 35 s after: bench/results/h100/round25-2026-12-06/README.md)
        os.nice(NICENESS)
        device = spec.topology.targets[0]
        tgt = load_target(spec.target, device, seed=spec.seed)
        drafter = random_drafter(spec, device)
        embed, head = target_embeddings(spec.target, spec.seed)
        first = load_eval_sets(spec, None, tgt.tokenizer, b.eval_sets[:1], b.eval_prompts)[0]
        clock.end("load")
        print(f"[decoders] compiling the bench's decoding sweep ahead: batch sizes "
              f"{list(b.decode_batches)}, verify widths {list(b.decode_widths)} beside the "
              f"full block, on {len(first.prompts)} {first.name} prompts "
              f"({b.decode_shapes} shapes; cache {cache})", flush=True)
        try:
            rows = compile_ahead(tgt.model, drafter, **sweep_arguments(
                b, tgt.tokenizer, first.prompts, eos_ids_of(tgt), embed, head))
        except Exception as e:  # noqa: BLE001 - recorded: the bench still runs, compiling itself
            failed = failure_line(e, ctx.results / "decoders" / "error.txt")
            print(f"[decoders] warning: compiling ahead failed ({failed}); the bench stage "
                  f"compiles its decoders itself", flush=True)
        clock.end("compile")
    else:
        print(f"[decoders] nothing to compile ahead: {skipped}", flush=True)
    total = clock.elapsed()
    manifest = write_manifest(
        ctx.results / "decoders" / "manifest.json", "decoders",
        fingerprints={"env": ctx.env_fingerprint, "decoders": spec.fingerprint("decoders")},
        skipped=skipped, failed=failed, compiled=rows, compile_cache=str(cache),
        seconds_total=round(total, 3), seconds_by_phase=clock.seconds,
        gate=get_gate().stats().summary(),
        peak_device_memory=peak_device_memory(spec.topology.targets[:1]),
        env_drift_overridden=ctx.drift)
    print(f"[decoders] done: {len(rows)} decoder(s) compiled ahead in {total:.1f}s", flush=True)
    return manifest
