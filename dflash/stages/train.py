"""The train stage: warm start, race-free threaded training, checkpoints, export, manifest.

``dflash train specs/<name>.yaml`` → results/<name>/train/{manifest.json, metrics.jsonl,
status.json, checkpoints/, drafter/}. A killed run started again resumes from the newest good
checkpoint (Snakemake keeps the checkpoints: they are not declared outputs).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from . import checkpoint as ckpt
from .manifest import atomic_write_text, expect, read_manifest, write_manifest
from .cache import compile_cache_dir
from .stage import StageContext


def total_steps_for(spec, step_map) -> int:
    """One step trains one batch on every drafter replica."""
    o = spec["optim"]
    return o["max_steps"] if o["max_steps"] is not None else step_map.total_for_epochs(o["epochs"])


def verify_warmup(ctx: StageContext) -> dict:
    path = ctx.results / "warmup" / "manifest.json"
    m = read_manifest(path, "warmup")
    expect(m, path, {"env": ctx.env_fingerprint, "shape": ctx.spec.fingerprint("warmup")})
    return m


def injected_failures() -> dict[str, int]:
    """Test hook: DFLASH_FAIL_AT="drafter-0:3,target-0:5" makes that worker raise at that step
    (failure-propagation and rerun-after-failure tests use it on the real stage)."""
    import os

    out = {}
    for part in filter(None, os.environ.get("DFLASH_FAIL_AT", "").split(",")):
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
        return {"samples": len(ids), "distinct": len(set(ids)),
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


def run(ctx: StageContext, fail_at: dict | None = None, out: Path | None = None,
        max_steps: int | None = None, persist: bool = True) -> dict:
    """Train per the spec. ``out``/``max_steps``/``persist=False`` are for the bench stage's
    timed run: a fresh run of ``max_steps`` steps in its own folder, no checkpoints or resume."""
    from .data import load_dataset
    from .gate import get_gate
    from .packing import bucket_for, plan_epoch
    from .scheduler import Pipeline, StepMap
    from .status import StatusReporter
    from .topology import buckets, drafter_config, initial_state, make_replicas, \
        make_target_workers, warm_all, warm_targets
    from .packing import pack_row

    spec = ctx.spec
    t_start = time.perf_counter()
    fail_at = fail_at if fail_at is not None else injected_failures()
    warm = verify_warmup(ctx)
    cache = compile_cache_dir(ctx.env_fingerprint)
    ds = load_dataset(spec, ctx.results)
    out = out or ctx.results / "train"
    out.mkdir(parents=True, exist_ok=True)
    b = spec["batching"]
    bks = buckets(spec)
    pad_id = 0

    def epoch_batches(epoch: int) -> list[list[int]]:
        return plan_epoch(ds.lengths, b["token_budget"], b["max_batch_size"], spec["seed"], epoch)

    def make_row(batch: list[int]):
        return pack_row([ds.sample(i) for i in batch],
                        bucket_for(sum(ds.lengths[i] for i in batch), bks), pad_id)

    step_map = StepMap(epoch_batches, len(spec["topology"]["drafters"]))
    total_steps = total_steps_for(spec, step_map)
    if max_steps is not None:
        total_steps = max_steps
    cfg = drafter_config(spec)
    replicas = make_replicas(spec, cfg, initial_state(cfg, spec["seed"]), total_steps)

    start_step, counters = 0, {"tokens": 0, "samples": 0}
    ledger_state = None
    # a checkpoint only resumes the run it came from: same spec fields, data and shapes
    run_fp = {"train": spec.fingerprint("train"), "shape": spec.fingerprint("warmup"),
              "dataset_sha256": ds.manifest["dataset"]["sha256"]}
    found = ckpt.latest_good(out / "checkpoints") if persist else None
    if found is not None and found[1].get("run_fingerprint") != run_fp:
        print(f"[train] ignoring checkpoints in {out / 'checkpoints'}: they belong to another "
              f"run (spec fields, data or shapes changed); starting from step 0", flush=True)
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        found = None
    if found is not None:
        path, state = found
        ckpt.load_into(path, state, replicas)
        start_step, counters = state["step"], state["counters"]
        ledger_state = state.get("epochs_seen")
        print(f"[train] resuming from {path} (step {start_step}/{total_steps})", flush=True)

    # Warm start: every (replica, bucket) compiles once under the exclusive gate (fast: the
    # warmup stage filled the compile cache), then recompiles are refused and counted.
    gate = get_gate()
    t0 = time.perf_counter()
    feat_width = len(cfg.target_layer_ids) * cfg.hidden_size
    from .spec import dtype_of

    # targets first: loading a model imports its modeling module, which registers pytree node
    # types; a drafter graph compiled before that fails its pytree guard on the first real step
    # (measured on H200: "len(torch.utils._pytree.SUPPORTED_NODES) != 102")
    targets = make_target_workers(spec)
    warm_records = warm_targets(targets, bks, cfg.vocab_size)
    warm_records += warm_all(replicas, bks, feat_width, dtype_of(spec["target"]["dtype"]),
                             optimizer_step=False)
    gate.mark_warm()
    warm_start_s = time.perf_counter() - t0
    print(f"[train] warm start: {len(warm_records)} (worker, bucket) steps in "
          f"{warm_start_s:.1f}s; gate now refuses recompiles", flush=True)

    metrics = MetricsLog(out / "metrics.jsonl", start_step)
    status = StatusReporter(out / "status.json", spec, total_steps)
    ledger = EpochLedger(ds.sample_ids, ledger_state)
    every = spec["checkpoint"]["every_steps"]

    def on_step(rec) -> None:
        counters["tokens"] += rec.tokens
        counters["samples"] += len(rec.sample_ids)
        ledger.add(rec.epoch, rec.sample_ids)
        metrics.write({"step": rec.step, "epoch": rec.epoch, "loss": rec.loss, "lr": rec.lr,
                       "grad_norm": rec.grad_norm, "tokens": rec.tokens,
                       "labelled": rec.labelled, "samples": len(rec.sample_ids),
                       "sample_ids": rec.sample_ids, "t": round(rec.t_end - t_pipe[0], 4)})
        status.step(rec)
        if persist and ((rec.step + 1) % every == 0 or rec.step + 1 == total_steps):
            ckpt.save(out / "checkpoints", rec.step + 1, replicas[0], dict(counters),
                      spec["checkpoint"]["keep"], run_fp, ledger.state())

    t_pipe = [time.perf_counter()]
    pipe = Pipeline(target_workers=targets, replicas=replicas, step_map=step_map,
                    make_row=make_row,
                    start_step=start_step, total_steps=total_steps, seed=spec["seed"],
                    mask_token_id=cfg.mask_token_id, queue_depth=spec["topology"]["queue_depth"],
                    on_step=on_step, fail_at=fail_at)
    try:
        pipe.run(on_tick=status.tick, tick_s=5.0)
    finally:
        metrics.close()
    train_s = time.perf_counter() - t_pipe[0]

    # every replica must hold the same weights (data parallel, identical updates)
    ref = replicas[0].model.state_dict()
    replicas_identical = all(torch.equal(ref[k].cpu(), r.model.state_dict()[k].cpu())
                             for r in replicas[1:] for k in ref)
    from .model import export_drafter

    export_dir = out / "drafter"
    if persist:  # the exported HF folder appears complete or not at all
        tmp_export = out / ".drafter.tmp"
        shutil.rmtree(tmp_export, ignore_errors=True)
        export_drafter(replicas[0].model, cfg, tmp_export)
        shutil.rmtree(export_dir, ignore_errors=True)
        tmp_export.rename(export_dir)

    st = gate.stats()
    steps_run = total_steps - start_step
    steady = status.steady_state()
    manifest = write_manifest(
        out / "manifest.json", "train",
        fingerprints={"env": ctx.env_fingerprint, "shape": spec.fingerprint("warmup"),
                      "train": spec.fingerprint("train"),
                      "data": ds.manifest["fingerprints"]["data"],
                      "dataset_sha256": ds.manifest["dataset"]["sha256"],
                      "warmup": warm["checksum"]},
        steps={"total": total_steps, "run_now": steps_run, "resumed_from": start_step,
               "epoch_starts": step_map.starts},
        counters=counters, compile_cache=str(cache),
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
        wall_s=round(time.perf_counter() - t_start, 3), train_s=round(train_s, 3),
        steady_state=steady, final_loss=pipe.last_record.loss if pipe.last_record else None,
        replicas=len(replicas), replicas_identical=replicas_identical,
        exactly_once=ledger.report(),
        drafter_dir=str(export_dir), env_drift_overridden=ctx.drift,
        topology=spec["topology"])
    status.done(manifest)
    print(f"[train] done: {steps_run} steps in {train_s:.1f}s, final loss "
          f"{manifest['final_loss']}, recompiles after warmup "
          f"{manifest['gate']['recompiles_after_warmup']}, race errors "
          f"{manifest['gate']['race_errors']}", flush=True)
    return manifest

