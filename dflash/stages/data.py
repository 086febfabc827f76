"""The data stage: prompts -> target-regenerated responses -> token ids (+ manifest).

    dflash data specs/tiny.yaml            # writes results/tiny/data/

Output (``results/<spec>/data/``): ``dataset.parquet`` (one row per sample, sorted by
``sample_id``) and ``manifest.json``. Generation is split into fixed chunks of
``data.gen_batch_size`` samples (prompts of similar length together, so left padding is small);
each finished chunk is written atomically as ``shards/part-<chunk>.parquet``. A restarted run
keeps the shards made from the same inputs and generates only the missing samples, so nothing is
generated twice and nothing is lost; shards made from other inputs are discarded (and said so):
:mod:`dflash.data.chunks` (the plan, its shards, resume and merge).

Chunks are spread over ``topology.targets`` (one thread per entry, each with its own target copy;
several ``cpu`` entries share the CPU). ``data.engine`` picks the generator: ``fast``
(:mod:`dflash.decode.engine`: every chunk of a worker streams through one continuous batch of
``gen_batch_size`` slots; a chunk's shard is written when its last sample finishes) or ``hf``
(:func:`dflash.decode.generate.generate_batch`, one chunk per batch), both behind
:func:`dflash.decode.generate.open_generator` and its worker pool
:func:`dflash.data.generate.generate_chunks`; ``auto`` takes ``fast`` where it supports the
architecture. Sampling (``temperature > 0``) is seeded per sample (``sample_seed``), so a
sample does not depend on which device or batch produced it.

Which prompts (one ``data.source`` or a mix, target-written prompts, decontamination against
MT-Bench and HumanEval) is :mod:`dflash.data.sources`; docs/data.md has the details.
"""
from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq

from ..artifacts.code_fingerprint import stage_code_fingerprint
from ..data.check import check_data
from ..data.chunks import SHARDS, keep_shards, make_chunks, merge_shards, write_chunk
from ..data.dataset import DATASET
from ..data.generate import ChunkProgress, generate_chunks
from ..decode.generate import eos_ids_of, open_generator, resolve_engine, sample_seed
from ..data.sources import (
    SYNTHETIC,
    build_samples,
    engine_compile,
    log,
    synthetic_responses,
    tokenizer_for,
)
from ..eval.evalsets import eval_overlap
from ..artifacts.manifest import atomic_path, fingerprint, sha256_file, write_manifest
from ..models.target import load_target, target_fingerprint
from ..runtime import faults
from ..runtime.clock import PhaseClock
from ..runtime.device_memory import peak_device_memory
from ..train.budget import check_disk  # no rerun trigger: code_fingerprint.NOT_RERUN_TRIGGERS
from . import StageContext


def _stats(values: list[int]) -> dict:
    return {"mean": round(sum(values) / len(values), 3) if values else 0.0,
            "min": min(values, default=0), "max": max(values, default=0), "total": sum(values)}


def run(ctx: StageContext) -> dict:
    """Build (or resume) ``results/<spec>/data``; returns the manifest. After each shard is
    written, :func:`dflash.runtime.faults.shard_written` runs the test hooks (tests use it to
    simulate an interruption)."""
    spec = ctx.spec
    clock = PhaseClock()
    check_data(spec)                      # the model-free checks again, with field path and file
    check_disk(spec, ctx.results.parent)  # the run's disk budget fits, before any generation
    d = spec.data
    data_dir = ctx.results / "data"
    shard_dir = data_dir / SHARDS
    fingerprints = {"data": spec.fingerprint("data"), "target": target_fingerprint(spec.target)}
    code = stage_code_fingerprint("data")  # shards of other generating code are made again

    # the phases' wall seconds (the manifest's seconds_by_phase; the write after it, the log
    # line): round 19's 248 s stage had ~55 s outside the self-written prompts and the timed
    # generation that no log line accounted for
    clock.end("checks")
    tokenizer = None if d.source == SYNTHETIC else tokenizer_for(spec.target.model)
    samples, report, prompts, per_source = build_samples(spec, tokenizer, data_dir,
                                                         overlap=eval_overlap)
    clock.end("prompts")
    chunks = make_chunks(samples, d.gen_batch_size)
    plan_fp = fingerprint([[s.sample_id, list(s.prompt_ids)] for c in chunks for s in c])
    meta = {"fingerprints": fingerprints, "plan": plan_fp, "code": code}
    log(f"{len(prompts)} prompts from {d.source or ', '.join(per_source)} "
         f"({report.total} records, {report.summary()}, {report.duplicates} duplicates) -> "
         f"{len(samples)} samples in "
         f"{len(chunks)} chunks of <= {d.gen_batch_size}")

    done = keep_shards(shard_dir, meta, chunks)
    todo = [(i, c) for i, c in enumerate(chunks) if c[0].sample_id not in done]
    resumed = len(chunks) - len(todo)
    if resumed:
        log(f"resuming: {len(done)} samples in {resumed} chunk(s) already done, "
             f"{sum(len(c) for _, c in todo)} samples in {len(todo)} chunk(s) to generate")
    clock.end("plan")
    gen = _generate(spec, todo, shard_dir, len(chunks), resumed)
    clock.end("generation")  # the target's load and the engine's set-up included

    table = merge_shards(shard_dir, chunks, samples)
    clock.end("merge")
    manifest = _write(spec, data_dir, table, fingerprints, plan_fp, report, prompts, chunks,
                      resumed, gen, clock.elapsed(), per_source,
                      {"env_drift_overridden": ctx.drift, "shared_with": ctx.shared_with,
                       "peak_device_memory": peak_device_memory(spec.topology.targets),
                       "seconds_by_phase": dict(clock.seconds)})
    clock.end("write")
    log(f"wrote {data_dir / DATASET}: {table.num_rows} samples, "
         f"{manifest['tokens']['total_tokens']} tokens in {clock.elapsed():.1f}s "
         f"({clock.summary()})")
    return manifest


def _generate(spec, todo, shard_dir: Path, n_chunks: int, resumed: int) -> dict:
    """Generate the ``todo`` chunks into shards; returns what the manifest records about it."""
    info: dict = {"seconds": 0.0, "new_tokens": 0, "engine": None, "engines": {}}
    if not todo:
        return info
    if spec.data.source == SYNTHETIC:
        for chunk, samples in todo:
            responses, eos = synthetic_responses(spec, samples)
            write_chunk(shard_dir, chunk, samples, responses, {eos})
        log(f"synthetic responses for {sum(len(c) for _, c in todo)} samples")
        info["engine"] = SYNTHETIC
        return info
    d = spec.data
    devices = list(spec.topology.targets)[:len(todo)]
    t_load = time.time()
    targets = dict(zip(devices, [load_target(spec.target, dev, seed=spec.seed)
                                 for dev in devices]))
    log(f"loaded {len(targets)} target cop{'y' if len(targets) == 1 else 'ies'} on "
         f"{', '.join(devices)} in {time.time() - t_load:.1f}s")
    eos = eos_ids_of(targets[devices[0]])
    info["engine"] = engine = resolve_engine(d.engine, targets[devices[0]].model)
    by_chunk = dict(todo)
    progress = ChunkProgress(n_chunks, resumed, log, every_chunk=engine == "hf")

    def open_one(dev: str):
        # the fast engine's cache holds the longest prompt still to generate + max_new_tokens;
        # no more slots than samples (idle slots cost steps)
        return open_generator(
            engine, targets[dev], slots=d.gen_batch_size,
            max_len=max(len(s.prompt_ids) for _, c in todo for s in c) + d.max_new_tokens,
            max_new_tokens=d.max_new_tokens, temperature=d.temperature,
            compile=engine_compile(spec, dev), items=sum(len(c) for _, c in todo))

    def on_chunk(dev: str, chunk: int, responses: list, tc: float) -> None:
        samples = by_chunk[chunk]
        path = write_chunk(shard_dir, chunk, samples, responses, set(eos))
        progress.done(dev, len(samples), sum(len(r) for r in responses), tc)
        faults.shard_written(chunk, path)

    chunks = ((chunk, [s.prompt_ids for s in samples],
               [sample_seed(spec.seed, s.sample_id) for s in samples])
              for chunk, samples in todo)
    # one worker per target copy; the first error (or Ctrl-C) stops them all, finished shards
    # stay and the rerun resumes from them
    gens = generate_chunks(devices, open_one, chunks, on_chunk)
    info["engines"] = {dev: g.settings() for dev, g in zip(devices, gens) if g.settings()}
    setup = max(g.setup_seconds for g in gens)
    info["seconds"] = time.time() - progress.t0 - setup  # compile + capture apart
    info["new_tokens"] = progress.new_tokens
    return info


def _write(spec, data_dir: Path, table, fingerprints, plan_fp, report, prompts, chunks,
           resumed, gen: dict, seconds, per_source: dict, of_run: dict) -> dict:
    """``of_run``: what the stage context adds (the drift overridden, the specs sharing the entry)."""
    d = spec.data
    out = data_dir / DATASET
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp)
    sha = sha256_file(out)
    p_tok = table["num_prompt_tokens"].to_pylist()
    r_tok = table["num_response_tokens"].to_pylist()
    eos_stops = sum(table["stopped_at_eos"].to_pylist())
    return write_manifest(
        data_dir / "manifest.json", "data", fingerprints=fingerprints,
        source=d.source or "mix",
        sources=per_source,
        counts={"prompts": len(prompts), "samples": table.num_rows,
                "stopped_at_eos": eos_stops, "hit_max_new_tokens": table.num_rows - eos_stops,
                **report.to_dict()},
        tokens={"prompt": _stats(p_tok), "response": _stats(r_tok),
                "sequence_max": max(p + r for p, r in zip(p_tok, r_tok)),
                "total_tokens": sum(p_tok) + sum(r_tok)},
        generation={"max_new_tokens": d.max_new_tokens, "temperature": d.temperature,
                    "samples_per_prompt": d.samples_per_prompt,
                    "gen_batch_size": d.gen_batch_size,
                    "max_prompt_tokens": d.max_prompt_tokens,
                    "devices": list(spec.topology.targets), "chunks": len(chunks),
                    "chunks_resumed": resumed, "plan": plan_fp,
                    "engine_requested": d.engine, "engine": gen["engine"],
                    "engine_settings": gen["engines"],
                    "generate_seconds": round(gen["seconds"], 2),
                    "new_tokens_generated": gen["new_tokens"],
                    # this run's generation only (resumed shards excluded), engine setup and
                    # compile excluded (engine_settings.*.setup_seconds)
                    "new_tokens_per_second": round(gen["new_tokens"] / gen["seconds"], 2)
                    if gen["seconds"] else None},
        seed=spec.seed,
        dataset={"path": DATASET, "rows": table.num_rows, "sha256": sha},
        files={DATASET: sha},  # by content (dflash.artifacts.manifest.verify_files)
        seconds=round(seconds, 2),
        **of_run,
    )
