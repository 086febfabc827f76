"""Fault injection: kill -9 the train stage at random moments, resume, compare with a clean run.

    python -m bench.fault_injection --kills 20 --seed 0 --out bench/results/cpu/fault_injection.json

What it does, for real (no mocks), in a temporary copy of the workflow:

1. ``snakemake --cores 2 data_<spec> warmup_<spec>`` once for a spec derived from
   ``tests/specs/micro.yaml`` (random-weight Llama target, two drafter threads on CPU).
2. A reference run: ``python -m dflash train specs/<spec>.yaml --results <root>`` uninterrupted
   → reference drafter weights, final optimizer state and the consumed sample ids per step.
3. Campaigns, in a fresh results root: train from scratch with the same stage command,
   SIGKILL its process group after a seeded random delay between process start and the
   expected end of this run (startup + the steps still to do, estimated from the reference),
   restart, ... until a run completes; then start the next campaign, until N kills in all.
   Each kill records where it landed (startup / training), the step reached, the newest
   checkpoint, and the work lost: seconds of that process's work no checkpoint preserved
   (kill time − max(process start, newest checkpoint written by that process)).
4. Comparison, per campaign: final exported weights and final optimizer state ``torch.equal`` to the
   reference on every tensor; the consumed sample ids rebuilt from the *killed runs' own*
   metrics (each run contributes steps [its resume step, the next run's resume step)) compared
   with the reference step by step: samples lost, samples duplicated, each epoch exactly once.

The machinery is :mod:`dflash.runtime.faults`, shared with ``tests/test_resume.py`` (a short version
with >= 3 kills).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.entry import command_line
from dflash.runtime.faults import (
    REPO,
    Run,
    Workflow,
    checkpoints,
    compare_ids,
    dataset_ids,
    decided,
    derived_spec,
    epochs_exactly_once,
    final_tensors,
    metrics_steps,
    newest_checkpoint,
    prepare,
    reference,
    stitch,
    tensors_equal,
    wait_until,
)


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------
@dataclass
class KillRecord:
    attempt: int
    delay_s: float
    landed: str = ""
    resumed_from: int = 0
    step_reached: int = -1
    newest_checkpoint: int = -1
    work_lost_s: float = 0.0
    since_checkpoint_s: float | None = None
    steps_lost: int = 0
    notes: list = field(default_factory=list)


STARTUP_SHARE = 0.3


def kill_delay(rng: random.Random, ref: dict, remaining_steps: int) -> float:
    """Seconds after process start, between start and the expected end of this run: with
    probability STARTUP_SHARE uniform over the expected startup (imports, checkpoint load, warm
    start), else uniform over the expected training time still to do. (A plain uniform draw over
    the whole run would, once the remaining work is short, land nearly every kill in startup.)"""
    startup, train = ref["startup_s"], remaining_steps * ref["step_s"]
    if rng.random() < STARTUP_SHARE:
        return rng.uniform(0.0, startup)
    return rng.uniform(startup, startup + train)


def campaign(w: Workflow, root: str, logs: Path, budget: int, ref: dict, rng: random.Random,
             index: int = 1, log=print) -> dict:
    """One training from scratch, killed at seeded random moments (at most ``budget`` kills)
    and restarted each time, until a run completes; then compared with the reference.

    No kill is drawn once the final checkpoint exists (only export and manifest are left): the
    next run just finishes. A kill's resume succeeded when the next run that got past its resume
    decision resumed from exactly the newest checkpoint the killed run left (0: none)."""
    td = w.train_dir(root)
    shutil.rmtree(td, ignore_errors=True)
    total = ref["steps"]
    records: list[KillRecord] = []
    runs: list[tuple[Run, KillRecord | None, dict]] = []
    attempt = 0
    completed_before_kill = 0
    while True:
        attempt += 1
        run = w.start("train", root, logs / f"campaign-{index:02d}-attempt-{attempt:02d}.log")
        remaining = total - max(0, newest_checkpoint(td))
        if len(records) >= budget or remaining <= 0:
            if run.wait() != 0:
                raise RuntimeError(f"final run failed:\n{run.text()[-3000:]}")
            runs.append((run, None, metrics_steps(td / "metrics.jsonl")))
            break
        delay = kill_delay(rng, ref, remaining)
        rec = KillRecord(attempt=attempt, delay_s=round(delay, 3))
        deadline = run.t0 + delay
        wait_until(lambda: time.time() >= deadline, run, timeout=delay + 600)
        if not run.alive():  # finished before its kill: training is complete
            completed_before_kill += 1
            if run.proc.wait() != 0:
                raise RuntimeError(f"run failed:\n{run.text()[-3000:]}")
            log(f"campaign {index} attempt {attempt}: finished before its kill at {delay:.1f}s",
                flush=True)
            runs.append((run, None, metrics_steps(td / "metrics.jsonl")))
            break
        steps = examine_kill(run, rec, td, run.kill(), total)
        records.append(rec)
        runs.append((run, rec, steps))
        log(f"campaign {index} kill {len(records)} at {delay:5.1f}s ({rec.landed}): resumed "
            f"from {rec.resumed_from}, reached step {rec.step_reached}, newest checkpoint "
            f"{rec.newest_checkpoint}, work lost {rec.work_lost_s:.2f}s", flush=True)
    return campaign_result(td, index, ref, runs, records, attempt, completed_before_kill, log)


def examine_kill(run: Run, rec: KillRecord, td: Path, t_kill: float, total: int) -> dict:
    """Fill ``rec`` for a run killed at ``t_kill``: where it resumed from, the step it reached,
    the newest checkpoint, the work lost and where the kill landed; -> the steps' metrics."""
    text = run.text()
    rec.resumed_from = run.resumed_from()
    steps = metrics_steps(td / "metrics.jsonl")
    mine = {s: r for s, r in steps.items() if s >= rec.resumed_from} if decided(run) else {}
    rec.step_reached = max(mine) if mine else rec.resumed_from - 1
    ckpts = checkpoints(td)
    rec.newest_checkpoint = ckpts[-1][0] if ckpts else 0
    written_here = [(s, t) for s, t in ckpts if t >= run.t0]
    rec.work_lost_s = round(t_kill - max([run.t0] + [t for _, t in written_here]), 3)
    if written_here:
        rec.since_checkpoint_s = round(t_kill - written_here[-1][1], 3)
    rec.steps_lost = max(0, rec.step_reached + 1 - rec.newest_checkpoint)
    if "[train] warm start" not in text:
        rec.landed = "startup"
    elif not mine:
        rec.landed = "after warm start, before the first step"
    elif rec.newest_checkpoint >= total:
        rec.landed = "after the final checkpoint (export/manifest)"
    elif written_here and rec.newest_checkpoint == rec.step_reached + 1:
        rec.landed = "right after a checkpoint"
    else:
        rec.landed = "mid-training"
    if "Traceback" in text:
        rec.notes.append("traceback in log")
    return steps


def check_resumes(runs: list) -> int:
    """Mark each kill's record: did the next run that decided resume from its newest
    checkpoint; -> how many did."""
    resumes_ok = 0
    for i, (_, rec, _) in enumerate(runs):
        if rec is None:
            continue
        nxt = next((r for r, _, _ in runs[i + 1:] if decided(r)), None)
        ok = nxt is not None and nxt.resumed_from() == rec.newest_checkpoint
        rec.notes.append("resume ok" if ok else "RESUME MISMATCH")
        resumes_ok += ok
    return resumes_ok


def campaign_result(td: Path, index: int, ref: dict, runs: list, records: list, attempt: int,
                    completed_before_kill: int, log) -> dict:
    """The campaign's figures: resumes, final tensors against the reference, samples."""
    total = ref["steps"]
    resumes_ok = check_resumes(runs)
    # the steps each run contributed: [its resume step, the step the next deciding run resumed
    # from); runs that never got to their resume decision contributed nothing
    deciding = [(r, steps) for r, _, steps in runs if decided(r)]
    segments = []
    for i, (r, steps) in enumerate(deciding):
        end = deciding[i + 1][0].resumed_from() if i + 1 < len(deciding) else total
        segments.append((r.resumed_from(), end, steps))
    manifest = json.loads((td / "manifest.json").read_text())
    got_w, got_o = final_tensors(td)
    w_ok, w_bad = tensors_equal(ref["tensors"][0], got_w)
    o_ok, o_bad = tensors_equal(ref["tensors"][1], got_o)
    stitched = compare_ids(ref["metrics"], stitch(segments))
    final = compare_ids(ref["metrics"], {s: r["sample_ids"] for s, r in
                                         metrics_steps(td / "metrics.jsonl").items()})
    out = {"campaign": index, "kills": len(records), "attempts": attempt,
           "resumes_succeeded": resumes_ok, "completed_before_a_kill": completed_before_kill,
           "final_resumed_from": manifest["steps"]["resumed_from"],
           "final_replicas_identical": manifest["replicas_identical"],
           "weights_identical": w_ok, "weights_differing": w_bad,
           "optimizer_state_identical": o_ok, "optimizer_differing": o_bad,
           "samples_lost": stitched["samples_lost"],
           "samples_duplicated": stitched["samples_duplicated"],
           "steps_identical_to_reference": stitched["steps_identical"],
           "epochs": stitched["epochs"],
           "final_metrics_log": {k: final[k] for k in ("samples_lost", "samples_duplicated",
                                                       "steps_identical")},
           "leftover_temp_entries": sorted(p.name for p in (td / "checkpoints").glob(".*")),
           "records": records}
    log(f"campaign {index}: {len(records)} kills, weights identical {w_ok}, optimizer "
        f"identical {o_ok}, samples lost {out['samples_lost']}, duplicated "
        f"{out['samples_duplicated']}", flush=True)
    return out


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=240, help="train steps (max_steps)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/cpu/fault_injection.json")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep the workflow copy here (default: a temporary folder, removed)")
    return ap.parse_args(argv)


def summary(a, argv, w, root: str, spec: dict, ref: dict, campaigns: list[dict]) -> dict:
    """The result JSON but its wall time: the campaigns' kills, resumes, samples and tensors."""
    all_ids = sorted(dataset_ids(w))
    recs = [r for c in campaigns for r in c["records"]]
    lost = [r.work_lost_s for r in recs]
    after_warm = [r.work_lost_s for r in recs if r.landed != "startup"]
    training = [r.work_lost_s for r in recs
                if r.landed in ("mid-training", "right after a checkpoint")]
    since = [r.since_checkpoint_s for r in recs if r.since_checkpoint_s is not None]
    every_epoch_once = all(epochs_exactly_once(c["epochs"], all_ids) for c in campaigns)
    return {
        "benchmark": "kill -9 fault injection, train stage",
        "command": command_line("bench.fault_injection", argv),
        "stage_command": " ".join(["python", "-m", "dflash", "train", w.spec_file(),
                                   "--results", root]),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "spec": {"base": "tests/specs/micro.yaml", "max_steps": a.steps,
                 "checkpoint_every_steps": a.every, "samples_per_epoch": len(all_ids),
                 "epochs": len({r["epoch"] for r in ref["metrics"].values()}),
                 "drafter_threads": 2, "seed": spec["seed"]},
        "kill_seed": a.seed,
        "kill_delay": f"seeded: with p={STARTUP_SHARE} U(0, expected startup), else "
                      f"U(expected startup, expected end of the steps still to do); none once "
                      f"the final checkpoint exists",
        "kills": len(recs),
        "campaigns": len(campaigns),
        "attempts": sum(c["attempts"] for c in campaigns),
        "resumes_succeeded": sum(c["resumes_succeeded"] for c in campaigns),
        "samples_lost": sum(c["samples_lost"] for c in campaigns),
        "samples_duplicated": sum(c["samples_duplicated"] for c in campaigns),
        "steps_identical_to_reference": all(c["steps_identical_to_reference"]
                                            for c in campaigns),
        "every_epoch_exactly_once": every_epoch_once,
        "weights_identical": all(c["weights_identical"] for c in campaigns),
        "optimizer_state_identical": all(c["optimizer_state_identical"] for c in campaigns),
        "replicas_identical": all(c["final_replicas_identical"] for c in campaigns),
        "work_lost_s": {
            "definition": "per kill: kill time - max(process start, newest checkpoint that "
                          "process wrote); includes the restart cost (imports, data, replicas, "
                          "checkpoint load, warm start) when no checkpoint was written yet",
            "per_kill": lost, **stats(lost),
            "kills_after_warm_start": stats(after_warm),
            "kills_while_training": stats(training)},
        "since_checkpoint_s": {
            "definition": "kill time - newest checkpoint written by the killed process "
                          "(kills after that process's first checkpoint)",
            "per_kill": since, **stats(since),
            "checkpoint_interval_s": round(a.every * ref["step_s"], 3)},
        "steps_lost_per_kill": [r.steps_lost for r in recs],
        "landed": dict(Counter(r.landed for r in recs)),
        "reference": {"wall_s": round(ref["wall_s"], 2), "train_s": ref["train_s"],
                      "ms_per_step": round(ref["step_s"] * 1000, 1),
                      "startup_s": round(ref["startup_s"], 2)},
        "per_campaign": [{k: v for k, v in c.items() if k not in ("records", "epochs")}
                         for c in campaigns],
        "kill_records": [dict(vars(r), campaign=c["campaign"]) for c in campaigns
                         for r in c["records"]],
    }


def stats(xs):
    return {"n": len(xs), "mean": round(sum(xs) / len(xs), 3) if xs else None,
            "max": max(xs, default=None)}


def main(argv=None) -> int:
    a = parse(argv)
    t_all = time.time()
    base = Path(a.workdir or tempfile.mkdtemp(prefix="dflash-fault-"))
    base.mkdir(parents=True, exist_ok=True)
    logs = base / "fault-logs"
    logs.mkdir(exist_ok=True)
    spec = derived_spec("faults", a.steps, a.every)
    print(f"preparing {base} (snakemake env, warmup, data)", flush=True)
    w = prepare(base / "wf", spec)
    print("reference run", flush=True)
    ref = reference(w, "results_ref", logs)
    print(f"reference: {ref['wall_s']:.1f}s wall, {ref['steps']} steps, "
          f"{ref['step_s'] * 1000:.0f} ms/step, startup {ref['startup_s']:.1f}s",
          flush=True)
    rng = random.Random(a.seed)
    root = w.fresh_root("results_kill")
    campaigns = []
    while sum(c["kills"] for c in campaigns) < a.kills:
        left = a.kills - sum(c["kills"] for c in campaigns)
        campaigns.append(campaign(w, root, logs, left, ref, rng, index=len(campaigns) + 1))
    out = summary(a, argv, w, root, spec, ref, campaigns)
    out["total_wall_s"] = round(time.time() - t_all, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("kills", "campaigns", "resumes_succeeded",
                                          "samples_lost", "samples_duplicated",
                                          "weights_identical", "optimizer_state_identical",
                                          "total_wall_s")}), flush=True)
    print(f"work lost per kill: mean {out['work_lost_s']['mean']}s, max "
          f"{out['work_lost_s']['max']}s; wrote {a.out}", flush=True)
    if a.workdir is None:
        shutil.rmtree(base, ignore_errors=True)
    ok = (out["weights_identical"] and out["optimizer_state_identical"]
          and out["samples_lost"] == 0 and out["samples_duplicated"] == 0
          and out["resumes_succeeded"] == out["kills"] and out["kills"] >= a.kills)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
