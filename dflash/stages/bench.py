"""The bench stage: throughput, MFU against a peak measured in the same run, τ — as a report.

Writes results/<spec>/bench/report.json, report.md (jinja2) and PNG plots. Throughput comes
from the train stage's steady state (bench.mode train_metrics) or from a fresh timed run of
``bench.warmup_steps + bench.steps`` steps (bench.mode run). τ of the exported drafter comes
from :mod:`dflash.eval.tau`: simulated acceptance on every ``bench.eval_sets`` set (MT-Bench
first turns, HumanEval, held-out training-source prompts), real speculative decoding on
``bench.real_prompts`` prompts of each (speed-up, and a check that its output equals the target's
own greedy output token for token and the simulated blocks); with ``bench.protocols`` holding
``reference``, the reference harness's MT-Bench protocol beside ours (:mod:`dflash.eval.reference`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..data.dataset import load_dataset
from ..decode.generate import eos_ids_of
from ..env.facts import hardware_facts
from ..errors import DFlashError
from ..eval.evalsets import load_eval_sets
from ..eval.reference import evaluate_reference, reference_questions
from ..eval.report import training_curves, write_report
from ..eval.serving import goal, sweep, sweep_arguments
from ..eval.tau import evaluate_sets
from ..artifacts.cache import compile_cache_dir
from ..artifacts.manifest import expect, read_manifest, verify_files
from ..models.drafter import DFlashConfig, load_drafter, verify_export
from ..models.dtypes import dtype_of
from ..models.target import hf_config, load_target, target_embeddings
from ..runtime.clock import PhaseClock
from ..runtime.status import by_role
from ..train.flops import drafter_useful_flops, measure_peak_flops, mfu_against_datasheet, target_flops, worker_balance
from ..train.trainer import timed_run
from . import StageContext, failure_line


# ---------------------------------------------------------------------------------------------
# acceptance length τ (the work is in dflash.eval.tau)
# ---------------------------------------------------------------------------------------------
def evaluate_tau(spec, drafter_dir: Path, device: str, results_dir: Path | None = None) -> dict:
    """τ of the exported drafter on the spec's eval sets (``bench.*``), as a dict for the report.

    Any failure becomes ONE message naming what failed and the spec fields / files involved;
    the traceback goes to ``bench/tau_error.txt`` beside the report, not to the console.
    """
    b = spec.bench
    if b.eval_prompts == 0 or not b.eval_sets:
        return {"skipped": "bench.eval_prompts is 0 or bench.eval_sets is empty"}
    if spec.target.init == "random":
        return {"skipped": "random-weight target: acceptance is meaningless"}
    step = "loading the target (target.model, target.dtype)"
    clock = PhaseClock()  # the τ part's seconds by phase (bench_seconds.tau_parts)
    try:
        tgt = load_target(spec.target, device, seed=spec.seed)
        step = f"loading the exported drafter {drafter_dir} (drafter.dtype)"
        drafter, cfg = load_drafter(drafter_dir, device=device,
                                    dtype=dtype_of(spec.drafter.dtype))
        drafter.eval()
        embed, head = target_embeddings(spec.target, spec.seed)
        step = "loading the eval prompts (bench.eval_sets)"
        sets = load_eval_sets(spec, results_dir, tgt.tokenizer, b.eval_sets,
                              b.eval_prompts)
        clock.end("load")
        step = (f"evaluating τ on {device} (target.dtype {spec.target.dtype}, "
                f"drafter.dtype {spec.drafter.dtype}, bench.eval_max_new_tokens "
                f"{b.eval_max_new_tokens}, bench.real_prompts {b.real_prompts})")
        per_set = evaluate_sets(tgt.model, drafter, embed, head, sets, b.eval_max_new_tokens,
                                eos_ids_of(tgt), b.real_prompts, device, b.eval_batch_size,
                                compile_shapes=b.decode_shapes)
        clock.end("eval_sets")
        step = (f"evaluating τ under the reference protocol (bench.protocols, "
                f"bench.reference_max_new_tokens {b.reference_max_new_tokens})")
        ref = (evaluate_reference(tgt.model, tgt.tokenizer, drafter,
                                  embed.to(device=device, dtype=drafter.dtype),
                                  head.to(device=device, dtype=drafter.dtype),
                                  reference_questions(b.eval_prompts, spec.seed),
                                  b.reference_max_new_tokens, eos_ids_of(tgt), device,
                                  b.eval_batch_size)
               if "reference" in b.protocols else None)
        if ref is None:
            clock.skip("reference")
        else:
            clock.end("reference")
    except DFlashError:
        raise
    except Exception as e:  # noqa: BLE001 - one message for the user, the traceback to a file
        where = None if results_dir is None else results_dir / "bench" / "tau_error.txt"
        raise DFlashError(f"bench: τ evaluation failed while {step}: "
                          f"{failure_line(e, where)}") from None
    speed = _decode_speed_or_failure(tgt, drafter, embed, head, sets[0], b, device, results_dir)
    clock.end("decode_sweep")
    # the headline figures are the first evaluated set's (mtbench by default)
    primary = next((k for k, v in per_set.items() if "tau" in v), None)
    first = per_set.get(primary, {})
    real = first.get("real") or {}
    return {"sets": per_set, "primary_set": primary, "tau": first.get("tau"),
            "tau_ci95": first.get("tau_ci95"),
            "protocols": protocols(per_set, ref, b),
            "prompts": first.get("prompts"), "block_size": cfg.block_size,
            "max_new_tokens": b.eval_max_new_tokens, "device": device,
            "accept_rate_by_position": first.get("accept_rate_by_position"),
            "lossless": real.get("lossless"), "real_prompts": real.get("prompts"),
            "target_only_tokens_per_s": real.get("target_only_tokens_per_s"),
            "speculative_tokens_per_s": real.get("speculative_tokens_per_s"),
            "speedup": real.get("speedup"), "decode_speed": speed,
            "seconds": part_seconds(clock.seconds, per_set, speed)}


def part_seconds(wall: dict, per_set: dict, speed: dict) -> dict:
    """Where the τ part of the bench stage's time went: loading (target, drafter, prompts),
    each eval set (simulated; real decoding on the first), the reference protocol, the decode
    sweep and, inside it, HF static generate's timed runs (its rows' seconds: the sweep's own
    untimed warm-ups are in decode_sweep_s only)."""
    hf = [r["hf_static"]["seconds"] for r in speed.get("batches") or () if r.get("hf_static")]
    return {**{k: None if v is None else round(v, 2) for k, v in wall.items()},
            "sets": {k: {"simulated_s": v.get("simulated_s"),
                         "real_s": (v.get("real") or {}).get("seconds")}
                     for k, v in per_set.items() if "tau" in v},
            "hf_static_timed_s": round(sum(hf), 2) if hf else None}


def protocols(per_set: dict, ref: dict | None, b) -> dict:
    """Ours and (when measured) the reference protocol side by side, each with both
    aggregation rules: pooled (total tokens / total verify steps) and the per-prompt mean."""
    mt = per_set.get("mtbench") or {}
    out = {"dflash": {"set": "mtbench", "turns": "first", "max_new_tokens": b.eval_max_new_tokens,
                      "prompts": mt.get("prompts"), "tau": mt.get("tau"),
                      "tau_prompt_mean": mt.get("tau_prompt_mean"),
                      "hit_cap": mt.get("hit_cap"),
                      **({} if mt else {"skipped": "mtbench is not in bench.eval_sets"})}}
    if ref is not None:
        out["reference"] = ref
    return out


def _decode_speed_or_failure(tgt, drafter, embed, head, es, b, device, results_dir) -> dict:
    """The batch sweep is a measurement beside τ: a failure there is recorded in the report
    (one line, the traceback in ``bench/decode_error.txt``) and costs the run its τ figures
    no more than it costs the user a rerun."""
    try:
        return decode_speed(tgt, drafter, embed, head, es, b, device)
    except Exception as e:  # noqa: BLE001 - recorded, not raised
        msg = failure_line(e, None if results_dir is None
                           else results_dir / "bench" / "decode_error.txt")
        print(f"[bench] warning: the decoding sweep failed: {msg}", flush=True)
        return {"failed": msg}


def decode_speed(tgt, drafter, embed, head, es, b, device) -> dict:
    """Tokens/s target-only vs speculative at ``bench.decode_batches`` (1, 4, 16, 64) on the
    primary set's prompts through the one decoder (the full block and each verify width of
    ``bench.decode_widths``; its regions compiled per ``bench.decode_shapes``), with the
    adaptive choice among them served at each, HF static-cache ``generate`` in the same run at
    batch 1 only (``serving.HF_BATCHES``), and the issue's batch-1 goal ratios. CUDA only: on
    CPU the decoder runs eagerly and times Python."""
    if not b.decode_batches:
        return {"skipped": "bench.decode_batches is []"}
    if not str(device).startswith("cuda"):
        return {"skipped": f"on {device}: the sweep times captured CUDA-graph steps"}
    if not es.prompts:
        return {"skipped": f"no {es.name} prompts"}
    r = sweep(tgt.model, drafter, **sweep_arguments(
        b, tgt.tokenizer, es.prompts, eos_ids_of(tgt), embed, head,
        log=lambda m: print(m.replace("[decode]", "[bench]"), flush=True)))
    r.pop("first")
    one = next((x for x in r["batches"] if x["batch"] == 1), None)
    return {**r, "set": es.name, "goal_batch1": goal(one) if one else None}


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def run(ctx: StageContext) -> dict:
    """The bench stage, as its phases: the throughput source (the train stage's steady state or
    a timed run), MFU against a peak measured now, τ of the exported drafter, the report."""
    out = ctx.results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # the env's compile cache, as warm-up and train use it: a rerun of this stage, or the next
    # arm's bench with the same drafter shapes, loads its decoders' kernels instead of compiling
    compile_cache_dir(ctx.env_fingerprint)
    train = verify_train(ctx)
    source, metrics = throughput_source(ctx, train, out)
    perf = throughput(ctx, source, metrics)
    t1 = time.perf_counter()
    drafter_dir = ctx.results / "train" / "drafter"
    tau = evaluate_tau(ctx.spec, drafter_dir, ctx.spec.topology.targets[0], ctx.results)
    t2 = time.perf_counter()
    facts = run_facts(ctx, source)
    report = {**perf, **facts, **training_curves(metrics),
              "tau": tau.get("tau"), "acceptance": tau,
              "gpu_minutes": gpu_minutes(ctx, train, facts["hardware"].get("gpu_count") or 0,
                                         t2 - t0, tau),
              # the stage's own cost by phase (the report's plots and files not counted)
              "bench_seconds": {"throughput_s": round(t1 - t0, 2), "tau_s": round(t2 - t1, 2),
                                "total_s": round(t2 - t0, 2),
                                "tau_parts": tau.get("seconds")},
              # monitor.profile_steps: the train stage's profile summary, shown as a table
              "profile": _read_json(ctx.results / "train" / "profile.json"),
              "decoders_ahead": decoders_ahead(ctx),
              "drafter_dir": str(drafter_dir)}
    return write_report(out, report, metrics, tau)


def decoders_ahead(ctx: StageContext) -> dict | None:
    """What the decoders stage compiled ahead for this bench's sweep (None: the spec has no
    such stage): its decoders and seconds, beside which the sweep's own compile seconds
    (``acceptance.decode_speed``, each engine's ``compile_seconds``) say what it saved."""
    path = ctx.results / "decoders" / "manifest.json"
    if not path.is_file():
        return None
    m = read_manifest(path, "decoders")
    return {"skipped": m.get("skipped"), "failed": m.get("failed"),
            "decoders": len(m.get("compiled") or ()),
            "seconds": m.get("seconds_total"), "workers": m.get("workers"),
            "same_env": m["fingerprints"].get("env") == ctx.env_fingerprint}


def gpu_minutes(ctx: StageContext, train: dict, gpus: int, bench_s: float, tau: dict) -> dict:
    """The run's GPU-minutes by stage beside its τ (issue #35's figure of merit): data (the data
    stage's seconds on the one target GPU that generates), train (the train stage's wall × the
    GPUs the spec holds), bench (this stage until the report; one GPU); 0 on CPU. ``gain``:
    (τ of the primary set − 1) per data + train GPU-minute (the target alone makes τ = 1)."""
    path = ctx.results / "data" / "manifest.json"
    data_s = read_manifest(path, "data").get("seconds") if path.is_file() else None
    one = min(gpus, 1)
    out = {"data": None if data_s is None else round(data_s / 60 * one, 3),
           "train": round((train.get("wall_s") or 0.0) / 60 * gpus, 3),
           "bench": round(bench_s / 60 * one, 3)}
    spent = (out["data"] or 0.0) + out["train"]
    t = tau.get("tau")
    return {**out, "gain_per_gpu_minute": round((t - 1) / spent, 4) if t and spent > 0 else None,
            "gain_set": tau.get("primary_set")}


def verify_train(ctx: StageContext) -> dict:
    tpath = ctx.results / "train" / "manifest.json"
    train = read_manifest(tpath, "train")
    expect(train, tpath, {"env": ctx.env_fingerprint, "train": ctx.spec.fingerprint("train"),
                          "shape": ctx.spec.fingerprint("warmup")})
    # the drafter bench evaluates, by content: a damaged one sets the train manifest aside
    # (Snakemake reruns train, which makes it again); then the folder's own check
    verify_files(train, tpath, "train")
    verify_export(ctx.results / "train" / "drafter")
    return train


def throughput_source(ctx: StageContext, train: dict, out: Path) -> tuple[dict, list[dict]]:
    """The manifest and per-step metrics throughput is read from: the train stage's
    (bench.mode train_metrics), or a fresh timed run's past its warm-up steps (bench.mode run)."""
    b = ctx.spec.bench
    if b.mode != "run":
        return train, _read_metrics(ctx.results / "train" / "metrics.jsonl")
    timed = timed_run(ctx, out / "run", b.warmup_steps + b.steps)
    return timed, _read_metrics(out / "run" / "metrics.jsonl")[b.warmup_steps:]


def throughput(ctx: StageContext, source: dict, metrics: list[dict]) -> dict:
    """Tokens/s, MFU (FLOPs from the configs and the tokens processed in the steady-state
    window, against a peak measured on the first drafter device now), busy/wait per step."""
    spec = ctx.spec
    steady = source["steady_state"]
    tcfg, dcfg = hf_config(spec.target), DFlashConfig.of_spec(spec)
    layers_run = max(dcfg.target_layer_ids) + 1
    skip = len(metrics) - steady["steps"] if steady.get("steps") else 0
    window = metrics[skip:] if metrics else []
    peak = measure_peak_flops(spec.topology.drafters[0], dtype_of(spec.drafter.dtype))
    seconds = steady.get("seconds") or None
    busy, wait = source.get("busy_s", {}), source.get("wait_s", {})
    # share of each target thread's life spent computing, not waiting for work or for room in
    # the queues (train_s also holds the final checkpoint, after the targets are done)
    target_busy = [v / (v + wait.get(k, 0.0)) for k, v in by_role(busy, "target").items()
                   if v + wait.get(k, 0.0) > 0]
    n_run = max(1, (source.get("steps") or {}).get("run_now") or steady.get("steps") or 1)
    n_t, n_d = len(spec.topology.targets), len(spec.topology.drafters)
    on_cpu = all(d == "cpu" for d in spec.devices())
    target_mfu = drafter_mfu = drafter_mfu_busy = None
    if window and seconds:
        ds_lengths = _doc_lengths_per_step(ctx, window)
        t_fl = sum(target_flops(tcfg, layers_run, d) for d in ds_lengths)
        # useful = labelled block positions (padded anchor slots are computed but not useful)
        d_fl = sum(drafter_useful_flops(dcfg, m["tokens"], m["labelled"]) for m in window)
        # CPU workers share one socket: the peak is the machine's, not per worker
        t_peak = peak["flops_per_s"] * (1 if on_cpu else n_t)
        d_peak = peak["flops_per_s"] * (1 if on_cpu else n_d)
        target_mfu, drafter_mfu = t_fl / seconds / t_peak, d_fl / seconds / d_peak
        # the drafter's MFU while it computes (a starved drafter idles; that is the target
        # side's share, not the drafter's efficiency): window FLOPs over its busy time there
        d_busy = [v / n_run for v in by_role(busy, "drafter").values()]
        if d_busy and not on_cpu and sum(d_busy) > 0:
            drafter_mfu_busy = d_fl / (sum(d_busy) / len(d_busy) * len(window)) / d_peak
    return {
        "balance": worker_balance(spec, dcfg, window, busy, wait, n_run),
        "tokens_per_s": steady.get("tokens_per_s"),
        "samples_per_s": (sum(m["samples"] for m in window[1:]) / seconds) if window and seconds
        else None,
        "target_mfu": target_mfu, "drafter_mfu": drafter_mfu,
        "drafter_mfu_while_busy": drafter_mfu_busy,
        # the same three over the GPU's datasheet dense peak (None on CPU / unlisted GPUs)
        "mfu_datasheet": mfu_against_datasheet(peak, target_mfu=target_mfu,
                                               drafter_mfu=drafter_mfu,
                                               drafter_mfu_while_busy=drafter_mfu_busy),
        "mfu_note": ("CPU: all workers share the machine; MFU is against the whole CPU's "
                     "measured fp32 matmul peak" if on_cpu
                     else "denominator: the per-GPU dense matmul peak measured on the first "
                          "drafter device (measured peak) × GPUs in role; the datasheet row "
                          "divides by the vendor's dense peak instead"),
        "peak": peak,
        "target_busy_fraction": (sum(target_busy) / len(target_busy)) if target_busy else None,
        "step_time": {"mean_s": steady.get("step_time_s"),
                      "busy_s_per_step": {k: v / n_run for k, v in busy.items()},
                      "wait_s_per_step": {k: v / n_run for k, v in wait.items()},
                      "steps": n_run,
                      "note": "busy: target forward (host-synced) / drafter fwd+bwd+optim "
                              "(CUDA events); wait: for inputs, room in queues, barriers"},
    }


def run_facts(ctx: StageContext, source: dict) -> dict:
    """What the report is about: the spec, the gate, the topology, the environment."""
    spec = ctx.spec
    return {
        "spec": spec.name, "mode": spec.bench.mode,
        "time_to_first_step_s": source.get("time_to_first_step_s"),
        "recompiles_after_warmup": source["gate"]["recompiles_after_warmup"],
        "race_errors": source["gate"]["race_errors"],
        "gate_wait_s": source["gate"]["shared_wait_s"] + source["gate"]["exclusive_wait_s"],
        "gate": "on" if source["gate"].get("enabled", True) else "off (DFLASH_GATE=off)",
        "final_loss": source.get("final_loss"),
        "topology": {"targets": spec.topology.targets,
                     "drafters": spec.topology.drafters, "nodes": spec.topology.nodes},
        # across nodes: seconds per step in the gradient all-reduce, bytes it moves
        "distributed": source.get("distributed", {"nodes": 1}),
        "hardware": hardware_facts(list(spec.topology.targets) + list(spec.topology.drafters),
                                   ctx.env_manifest),
        "env": {k: ctx.env_manifest.get(k) for k in ("python", "torch", "transformers",
                                                     "triton", "cuda", "driver", "gpus")
                if k in ctx.env_manifest},
        # what differed from the pinned env when DFLASH_ALLOW_DRIFT=1 overrode the refusal
        "env_drift_overridden": ctx.drift,
        "fingerprints": {"env": ctx.env_fingerprint, "spec_train": spec.fingerprint("train"),
                         "spec_shape": spec.fingerprint("warmup"),
                         "spec_bench": spec.fingerprint("bench")},
    }


def _doc_lengths_per_step(ctx, window: list[dict]) -> list[list[int]]:
    ds = load_dataset(ctx.spec, ctx.results)
    length = dict(zip(ds.sample_ids, ds.lengths))
    return [[length[s] for s in m["sample_ids"]] for m in window]
