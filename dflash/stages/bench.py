"""The bench stage: throughput, MFU against a peak measured in the same run, τ — as a report.

Writes results/<spec>/bench/report.json, report.md (jinja2) and PNG plots. Throughput comes
from the train stage's steady state (bench.mode train_metrics) or from a fresh timed run of
``bench.warmup_steps + bench.steps`` steps (bench.mode run). τ of the exported drafter comes
from :mod:`dflash.eval.tau`: simulated acceptance on every ``bench.eval_sets`` set (MT-Bench
first turns, HumanEval, held-out training-source prompts), real speculative decoding on
``bench.real_prompts`` prompts of each (speed-up, and a check that its output equals the target's
own greedy output token for token and the simulated blocks).
"""
from __future__ import annotations

import json
from pathlib import Path


from ..errors import DFlashError
from ..train.flops import (drafter_flops_per_step, drafter_useful_flops, measure_peak_flops,
                           mfu_against_datasheet, target_flops)
from ..manifest import atomic_path, atomic_write_json, atomic_write_text, expect, read_manifest
from . import StageContext


# ---------------------------------------------------------------------------------------------
# acceptance length τ (the work is in dflash.eval.tau)
# ---------------------------------------------------------------------------------------------
def evaluate_tau(spec, drafter_dir: Path, device: str, results_dir: Path | None = None) -> dict:
    """τ of the exported drafter on the spec's eval sets (``bench.*``), as a dict for the report.

    Any failure becomes ONE message naming what failed and the spec fields / files involved;
    the traceback goes to ``bench/tau_error.txt`` beside the report, not to the console.
    """
    from ..data.generate import eos_ids_of
    from ..eval.tau import evaluate_sets, load_eval_sets
    from ..models.drafter import load_drafter
    from ..spec import dtype_of
    from ..models.target import load_target, target_embeddings

    b = spec.bench
    if b.eval_prompts == 0 or not b.eval_sets:
        return {"skipped": "bench.eval_prompts is 0 or bench.eval_sets is empty"}
    if spec.target.init == "random":
        return {"skipped": "random-weight target: acceptance is meaningless"}
    step = "loading the target (target.model, target.dtype)"
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
        step = (f"evaluating τ on {device} (target.dtype {spec.target.dtype}, "
                f"drafter.dtype {spec.drafter.dtype}, bench.eval_max_new_tokens "
                f"{b.eval_max_new_tokens}, bench.real_prompts {b.real_prompts})")
        per_set = evaluate_sets(tgt.model, drafter, embed, head, sets, b.eval_max_new_tokens,
                                eos_ids_of(tgt), b.real_prompts, device, b.eval_batch_size)
    except DFlashError:
        raise
    except Exception as e:  # noqa: BLE001 - one message for the user, the traceback to a file
        import traceback

        where = ""
        if results_dir is not None:
            path = results_dir / "bench" / "tau_error.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, traceback.format_exc())
            where = f" (traceback in {path})"
        raise DFlashError(f"bench: τ evaluation failed while {step}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}{where}") from None
    # the headline figures are the first evaluated set's (mtbench by default)
    primary = next((k for k, v in per_set.items() if "tau" in v), None)
    first = per_set.get(primary, {})
    real = first.get("real") or {}
    return {"sets": per_set, "primary_set": primary, "tau": first.get("tau"),
            "prompts": first.get("prompts"), "block_size": cfg.block_size,
            "max_new_tokens": b.eval_max_new_tokens, "device": device,
            "accept_rate_by_position": first.get("accept_rate_by_position"),
            "lossless": real.get("lossless"), "real_prompts": real.get("prompts"),
            "target_only_tokens_per_s": real.get("target_only_tokens_per_s"),
            "speculative_tokens_per_s": real.get("speculative_tokens_per_s"),
            "speedup": real.get("speedup")}


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# The bench rule declares these as report outputs (rules/bench.smk), so every run writes all
# of them: a plot without data says why instead.
PLOTS = ("loss.png", "throughput.png", "draft_accuracy.png", "tau_training.png", "acceptance.png",
         "tau_by_category.png")


def _plots(out: Path, metrics: list[dict], tau: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def plot(name: str, draw, missing: str | None, **labels) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        if missing is None:
            draw(ax)
            ax.set(**labels)
        else:
            ax.set(title=labels.get("title"), xticks=[], yticks=[])
            ax.text(0.5, 0.5, missing, ha="center", va="center", wrap=True,
                    transform=ax.transAxes)
        fig.tight_layout()
        with atomic_path(out / name) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)

    no_steps = None if metrics else "no training steps recorded"
    steps, t = [m["step"] for m in metrics], [m["t"] for m in metrics]
    tps = [m["tokens"] / max(1e-9, t[i] - t[i - 1]) for i, m in enumerate(metrics) if i > 0]
    plot("loss.png", lambda ax: ax.plot(steps, [m["loss"] for m in metrics]), no_steps,
         xlabel="step", ylabel="loss", title="Training loss")
    plot("throughput.png", lambda ax: ax.plot(t[1:], tps), no_steps,
         xlabel="seconds", ylabel="target tokens / s", title="Throughput")
    acc = [(m["step"], m["draft_acc"]) for m in metrics if m.get("draft_acc")]

    def draw_acc(ax):
        n = len(acc[0][1])
        for k in sorted({1, 2, 4, 8, n} & set(range(1, n + 1))):
            ax.plot([s for s, _ in acc],
                    [a[k - 1] if a[k - 1] is not None else float("nan") for _, a in acc],
                    label=f"k = {k}")
        ax.set_ylim(0, 1)
        ax.legend()

    plot("draft_accuracy.png", draw_acc, None if acc else "no draft accuracy in the metrics",
         xlabel="step", ylabel="top-1 accuracy",
         title="Draft accuracy by block position (training batches)")
    taus = [(m["step"], m["tau_heldout"]) for m in metrics if "tau_heldout" in m]
    plot("tau_training.png", lambda ax: ax.plot(*zip(*taus), marker="o"),
         None if taus else "τ not monitored while training (monitor.tau_every_steps)",
         xlabel="step", ylabel="simulated τ (held-out)", title="τ while training")
    sets = {k: v for k, v in (tau.get("sets") or {}).items() if v.get("tau") is not None}
    no_tau = None if sets else f"τ not evaluated: {tau.get('skipped', 'no eval set gave a τ')}"

    def by_position(ax):
        for name, v in sets.items():
            r = v["accept_rate_by_position"]
            ax.plot(range(1, len(r) + 1), [x if x is not None else float("nan") for x in r],
                    marker="o", label=f"{name} (τ = {v['tau']:.2f})")
        ax.set_ylim(0, 1)
        ax.legend()

    plot("acceptance.png", by_position, no_tau, xlabel="block position k",
         ylabel="P(drafts 1..k accepted)", title="Acceptance by position (simulated)")
    cats = (sets.get("mtbench") or {}).get("tau_by_category")
    plot("tau_by_category.png", lambda ax: ax.bar(list(cats), list(cats.values())),
         None if cats else (no_tau or "no MT-Bench set evaluated (bench.eval_sets)"),
         xlabel="MT-Bench category", ylabel="τ", title="τ per MT-Bench category")
    return list(PLOTS)


def run(ctx: StageContext) -> dict:
    """The bench stage, as its phases: the throughput source (the train stage's steady state or
    a timed run), MFU against a peak measured now, τ of the exported drafter, the report."""
    out = ctx.results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    train = verify_train(ctx)
    source, metrics = throughput_source(ctx, train, out)
    perf = throughput(ctx, source, metrics)
    drafter_dir = ctx.results / "train" / "drafter"
    tau = evaluate_tau(ctx.spec, drafter_dir, ctx.spec.topology.targets[0], ctx.results)
    report = {**perf, **run_facts(ctx, source), **training_curves(metrics),
              "tau": tau.get("tau"), "acceptance": tau,
              "drafter_dir": str(drafter_dir)}
    return write_report(out, report, metrics, tau)


def verify_train(ctx: StageContext) -> dict:
    tpath = ctx.results / "train" / "manifest.json"
    train = read_manifest(tpath, "train")
    expect(train, tpath, {"env": ctx.env_fingerprint, "train": ctx.spec.fingerprint("train"),
                          "shape": ctx.spec.fingerprint("warmup")})
    return train


def throughput_source(ctx: StageContext, train: dict, out: Path) -> tuple[dict, list[dict]]:
    """The manifest and per-step metrics throughput is read from: the train stage's
    (bench.mode train_metrics), or a fresh timed run's past its warm-up steps (bench.mode run)."""
    b = ctx.spec.bench
    if b.mode != "run":
        return train, _read_metrics(ctx.results / "train" / "metrics.jsonl")
    from .train import timed_run

    timed = timed_run(ctx, out / "run", b.warmup_steps + b.steps)
    return timed, _read_metrics(out / "run" / "metrics.jsonl")[b.warmup_steps:]


def throughput(ctx: StageContext, source: dict, metrics: list[dict]) -> dict:
    """Tokens/s, MFU (FLOPs from the configs and the tokens processed in the steady-state
    window, against a peak measured on the first drafter device now), busy/wait per step."""
    from ..spec import dtype_of
    from ..models.target import hf_config
    from ..train.workers import drafter_config

    spec = ctx.spec
    steady = source["steady_state"]
    tcfg, dcfg = hf_config(spec.target), drafter_config(spec)
    layers_run = max(dcfg.target_layer_ids) + 1
    skip = len(metrics) - steady["steps"] if steady.get("steps") else 0
    window = metrics[skip:] if metrics else []
    peak = measure_peak_flops(spec.topology.drafters[0], dtype_of(spec.drafter.dtype))
    seconds = steady.get("seconds") or None
    busy, wait = source.get("busy_s", {}), source.get("wait_s", {})
    # share of each target thread's life spent computing, not waiting for work or for room in
    # the queues (train_s also holds the final checkpoint, after the targets are done)
    target_busy = [v / (v + wait.get(k, 0.0)) for k, v in busy.items()
                   if k.startswith("target") and v + wait.get(k, 0.0) > 0]
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
        d_busy = [v / n_run for k, v in busy.items() if k.startswith("drafter")]
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


BALANCE_MARGIN = 0.9  # recommended anchors fill this share of the target's step time


def worker_balance(spec, dcfg, window: list[dict], busy: dict, wait: dict, n_run: int) -> dict:
    """Per-GPU rates from busy time, the drafter's idle share, the ``batching.max_anchors``
    that would balance the drafter to the target, and projections to other GPU splits.

    Rates: a step trains one row per drafter and the targets share those rows, so a target GPU
    does ``tokens/step / T`` per its busy seconds and a drafter GPU ``tokens/step / D`` per its
    busy seconds (its capacity at the current anchors: it is busy only part of the step when
    starved). Anchors: a drafter step costs ``c0 + A·c1`` FLOPs (:func:`drafter_cost`: the
    context's K/V and fc are fixed, block tokens and the lm_head grow with the A anchor slots),
    and its busy time scales with that cost, so the anchors that make it busy
    ``BALANCE_MARGIN`` × the target's step are ``(margin·t/d·c(A) − c0) / c1``: more training
    signal per target token at no wall time while the drafter would idle (fewer when it is the
    bottleneck), capped at ``token_budget`` (spec validation) and rounded down to 64.
    """
    n_t, n_d = len(spec.topology.targets), len(spec.topology.drafters)
    t_busy = [v / n_run for k, v in busy.items() if k.startswith("target")]
    d_busy = [v / n_run for k, v in busy.items() if k.startswith("drafter")]
    if not window or not t_busy or not d_busy or min(t_busy + d_busy) <= 0:
        return {"skipped": "no steady-state steps or no busy times recorded"}
    t_busy_s, d_busy_s = sum(t_busy) / len(t_busy), sum(d_busy) / len(d_busy)
    tokens = sum(m["tokens"] for m in window) / len(window)
    labelled = sum(m["labelled"] for m in window) / len(window)
    b, B = spec.batching, spec.drafter.block_size
    target_rate = tokens / n_t / t_busy_s
    drafter_rate = tokens / n_d / d_busy_s
    idle = [wait.get(k, 0.0) / (v + wait.get(k, 0.0)) for k, v in busy.items()
            if k.startswith("drafter") and v + wait.get(k, 0.0) > 0]
    t_idle = [wait.get(k, 0.0) / (v + wait.get(k, 0.0)) for k, v in busy.items()
              if k.startswith("target") and v + wait.get(k, 0.0) > 0]
    row_tokens = tokens / n_d
    a_now = b.max_anchors
    c0 = drafter_cost(dcfg, row_tokens, 0, B)
    c_now = drafter_cost(dcfg, row_tokens, a_now, B)
    c1 = (c_now - c0) / a_now
    ideal = (BALANCE_MARGIN * t_busy_s / d_busy_s * c_now - c0) / c1
    rec = int(max(1, min(b.token_budget, ideal)))
    rec = max(1, rec - rec % 64) if rec >= 64 else rec
    rate_rec = drafter_rate * c_now / drafter_cost(dcfg, row_tokens, rec, B)
    splits = sorted({(n_t, n_d), *((t, 8 - t) for t in range(1, 8))})
    return {
        "target_tokens_per_s_per_gpu": target_rate,
        "drafter_tokens_per_s_per_gpu": drafter_rate,
        "target_busy_s_per_step": t_busy_s, "drafter_busy_s_per_step": d_busy_s,
        "drafter_idle_fraction": sum(idle) / len(idle) if idle else None,
        "target_idle_fraction": sum(t_idle) / len(t_idle) if t_idle else None,
        "anchors": {
            "max_anchors": a_now,
            # labelled positions per row / (B−1): slots a row could not fill count as unused
            "used_per_row": labelled / n_d / (B - 1),
            "recommended_max_anchors": rec, "margin": BALANCE_MARGIN,
            "unbounded_recommendation": round(ideal, 1),
            "drafter_tokens_per_s_per_gpu_at_recommended": rate_rec,
        },
        "projection": {
            "formula": "tokens/s = min(T × target tokens/s per GPU, D × drafter tokens/s per "
                       "GPU) from this run's per-GPU busy rates",
            "splits": [{"targets": t, "drafters": d,
                        "tokens_per_s": project_tokens_per_s(target_rate, drafter_rate, t, d),
                        "tokens_per_s_at_recommended_anchors":
                            project_tokens_per_s(target_rate, rate_rec, t, d)}
                       for t, d in splits],
        },
        "note": "busy totals over the run's steps (the first step included), tokens over the "
                "steady-state window; on CPU all workers share the cores, so rates there only "
                "describe this run",
    }


def drafter_cost(dcfg, row_tokens: float, anchors: int, block_size: int) -> float:
    """FLOPs a drafter step computes for one row with ``anchors`` slots (all slots run, padded
    or not): the cost model the anchor recommendation scales busy time with."""
    return drafter_flops_per_step(dcfg, row_tokens, anchors * block_size,
                                  anchors * (block_size - 1))


def project_tokens_per_s(target_rate: float, drafter_rate: float, targets: int,
                         drafters: int) -> float:
    """Target tokens/s of ``targets`` target GPUs + ``drafters`` drafter GPUs with the measured
    per-GPU rates: the slower side sets the pace (the pipeline overlaps the two)."""
    return min(targets * target_rate, drafters * drafter_rate)


def hardware_facts(devices: list[str], env_manifest: dict) -> dict:
    """The GPUs the run used: model name per topology device, their count, the NVIDIA driver
    (the env stage's record of this machine, else NVML, else nvidia-smi). CPU runs say so."""
    gpus = sorted({d for d in devices if d.startswith("cuda")},
                  key=lambda d: int(d.partition(":")[2] or 0))
    if not gpus:
        return {"accelerator": "cpu", "gpu_count": 0, "gpus": [], "driver": None,
                "note": "CPU run: no GPU in the topology"}
    import torch

    names = []
    for d in gpus:
        try:
            names.append({"device": d, "name": torch.cuda.get_device_name(torch.device(d))})
        except Exception as e:  # noqa: BLE001 - a report field, not a reason to fail the bench
            names.append({"device": d, "name": None, "error": f"{type(e).__name__}: {e}"})
    driver, source = (env_manifest.get("nvidia") or {}).get("driver"), "env manifest"
    if not driver:
        driver, source = _nvidia_driver()
    return {"accelerator": "cuda", "gpu_count": len(gpus), "gpus": names,
            "models": sorted({n["name"] for n in names if n["name"]}),
            "driver": driver, "driver_source": source if driver else None,
            "visible_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def _nvidia_driver() -> tuple[str | None, str | None]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return (v.decode() if isinstance(v, bytes) else str(v)), "pynvml"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - not installed or no driver: try the next source
        pass
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
            if out:
                return out[0].strip(), "nvidia-smi"
        except (OSError, subprocess.SubprocessError):
            pass
    return None, None


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


def write_report(out: Path, report: dict, metrics: list[dict], tau: dict) -> dict:
    """report.json, the plots, report.md (rendered from the package's template)."""
    report["plots"] = _plots(out, metrics, tau)
    atomic_write_json(out / "report.json", report)
    md = render_report_md(report)
    atomic_write_text(out / "report.md", md)
    print(md, flush=True)
    return report


def render_report_md(report: dict) -> str:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    env = Environment(loader=FileSystemLoader(Path(__file__).parents[1] / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("report.md.j2").render(r=report, fmt=_fmt)


def training_curves(metrics: list[dict]) -> dict:
    """What the drafter learnt while training: draft accuracy at the end, τ on held-out prompts
    along the way (when monitored)."""
    return {
        # per block position k = 1..B-1, mean over the last 10 logged steps
        "final_draft_acc": _last_draft_acc(metrics),
        "tau_while_training": [{"step": m["step"], "tau": m["tau_heldout"]} for m in metrics
                               if "tau_heldout" in m],
    }


def _last_draft_acc(metrics: list[dict], last: int = 10) -> list[float | None] | None:
    rows = [m["draft_acc"] for m in metrics[-last:] if m.get("draft_acc")]
    if not rows:
        return None
    out = []
    for k in range(len(rows[0])):
        vals = [r[k] for r in rows if r[k] is not None]
        out.append(round(sum(vals) / len(vals), 4) if vals else None)
    return out


def _doc_lengths_per_step(ctx, window: list[dict]) -> list[list[int]]:
    from ..data.dataset import load_dataset

    ds = load_dataset(ctx.spec, ctx.results)
    length = dict(zip(ds.sample_ids, ds.lengths))
    return [[length[s] for s in m["sample_ids"]] for m in window]


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)
