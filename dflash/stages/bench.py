"""The bench stage: throughput, MFU against a peak measured in the same run, τ — as a report.

Writes results/<spec>/bench/report.json, report.md (jinja2) and PNG plots. Throughput comes
from the train stage's steady state (bench.mode train_metrics) or from a fresh timed run of
``bench.warmup_steps + bench.steps`` steps (bench.mode run). τ comes from greedy speculative
decoding with the exported drafter on MT-Bench first turns (never trained on), with a check
that the output equals the target's own greedy output token for token.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .manifest import atomic_path, atomic_write_json, atomic_write_text, expect, read_manifest
from .stage import StageContext


# ---------------------------------------------------------------------------------------------
# peak and FLOP counting
# ---------------------------------------------------------------------------------------------
def best_seconds_per_call(fn, device: str, reps: int, warmup: int = 1, windows: int = 3) -> float:
    """Seconds per call of ``fn``: the best of ``windows`` timed windows of ``reps`` calls each,
    after ``warmup`` calls (the machine is shared; the best window is what it can do)."""
    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        fn()
    sync()
    best = float("inf")
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best / reps


def measure_peak_flops(device: str, dtype: torch.dtype) -> dict:
    """Dense matmul FLOP/s on ``device`` right now (the MFU denominator, measured not quoted)."""
    n = 8192 if device.startswith("cuda") else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 20 if device.startswith("cuda") else 3
    per_call = best_seconds_per_call(lambda: a @ b, device, reps)
    return {"device": device, "dtype": str(dtype).removeprefix("torch."), "n": n,
            "flops_per_s": 2 * n ** 3 / per_call, "threads": torch.get_num_threads()}


def _linear_params(cfg, layers: int) -> int:
    """Matmul parameters of ``layers`` Llama/Qwen-style decoder layers."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    attn = H * hd * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    return layers * (attn + 3 * H * I)


def target_flops(tcfg, layers_run: int, doc_lengths: list[int]) -> float:
    """Forward FLOPs of the (truncated) target over packed documents: 2·params·tokens plus
    causal attention (QK and AV: 2·2·heads·head_dim per visible key, ~len/2 keys on average)."""
    hd = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads
    tokens = sum(doc_lengths)
    attn = sum(4 * layers_run * tcfg.num_attention_heads * hd * n * (n + 1) / 2
               for n in doc_lengths)
    return 2 * _linear_params(tcfg, layers_run) * tokens + attn


def drafter_flops_per_step(dcfg, ctx_tokens: int, block_tokens: int, labelled: int) -> float:
    """Useful training FLOPs (forward + backward = 3× forward) of one replica step."""
    n_feat = len(dcfg.target_layer_ids)
    fwd = (2 * _linear_params(dcfg, dcfg.num_hidden_layers) * block_tokens
           # K/V projections of the injected context in every layer
           + 2 * ctx_tokens * dcfg.hidden_size * dcfg.head_dim * dcfg.num_key_value_heads * 2
           * dcfg.num_hidden_layers
           + 2 * ctx_tokens * n_feat * dcfg.hidden_size * dcfg.hidden_size      # fc
           + 2 * labelled * dcfg.hidden_size * dcfg.vocab_size)                 # lm_head
    return 3 * fwd


# ---------------------------------------------------------------------------------------------
# acceptance length τ
# ---------------------------------------------------------------------------------------------
def evaluate_tau(spec, drafter_dir: Path, n_prompts: int, max_new: int, device: str) -> dict:
    from .model import load_drafter
    from .prompts import load_mtbench
    from .spec_decode import speculative_generate, target_greedy
    from .target import load_target, target_embeddings

    if n_prompts == 0:
        return {"skipped": "bench.eval_prompts is 0"}
    if spec["target"]["init"] == "random":
        return {"skipped": "random-weight target: acceptance is meaningless"}
    tgt = load_target(spec["target"], device, seed=spec["seed"])
    drafter, cfg = load_drafter(drafter_dir, device=device)
    drafter.eval()
    embed, head = target_embeddings(spec["target"], spec["seed"])
    embed, head = embed.to(device), head.to(device)
    tok = tgt.tokenizer
    eos = tok.eos_token_id
    per_prompt, counts = [], [0] * (cfg.block_size - 1)
    t_base = t_spec = 0.0
    produced = forwards = blocks = 0
    lossless = True
    for q in load_mtbench(n_prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = (ids["input_ids"] if hasattr(ids, "keys") else ids).to(device)
        with torch.no_grad():
            t = time.perf_counter()
            base = target_greedy(tgt.model, ids, max_new, eos)
            t_base += time.perf_counter() - t
            t = time.perf_counter()
            res = speculative_generate(tgt.model, drafter, cfg, embed, head, ids, max_new, eos)
            t_spec += time.perf_counter() - t
        same = res.tokens == base
        lossless &= same
        produced += sum(res.block_lengths)
        forwards += res.target_forwards
        blocks += len(res.block_lengths)
        counts = [a + b for a, b in zip(counts, res.accept_counts)]
        per_prompt.append({"tau": res.tau, "tokens": len(res.tokens), "lossless": same})
    n_tokens = sum(p["tokens"] for p in per_prompt)
    return {
        "prompts": len(per_prompt), "max_new_tokens": max_new, "tau": produced / max(1, forwards),
        "accept_rate_by_position": [c / max(1, blocks) for c in counts],
        "lossless": lossless, "per_prompt": per_prompt,
        "target_only_tokens_per_s": n_tokens / t_base if t_base else None,
        "speculative_tokens_per_s": n_tokens / t_spec if t_spec else None,
        "speedup": (t_base / t_spec) if t_spec else None, "device": device,
    }


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------
def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _plots(out: Path, metrics: list[dict], tau: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def plot(name: str, draw, **labels) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        draw(ax)
        ax.set(**labels)
        fig.tight_layout()
        with atomic_path(out / name) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
        plt.close(fig)
        made.append(name)

    if metrics:
        steps, t = [m["step"] for m in metrics], [m["t"] for m in metrics]
        tps = [m["tokens"] / max(1e-9, t[i] - t[i - 1]) for i, m in enumerate(metrics) if i > 0]
        plot("loss.png", lambda ax: ax.plot(steps, [m["loss"] for m in metrics]),
             xlabel="step", ylabel="loss", title="Training loss")
        plot("throughput.png", lambda ax: ax.plot(t[1:], tps),
             xlabel="seconds", ylabel="target tokens / s", title="Throughput")
    rates = tau.get("accept_rate_by_position")
    if rates:
        plot("acceptance.png", lambda ax: ax.bar(range(1, len(rates) + 1), rates),
             xlabel="block position k", ylabel="accepted fraction",
             title=f"Acceptance by position (τ = {tau['tau']:.2f})")
    return made


def run(ctx: StageContext) -> dict:
    from jinja2 import Environment, FileSystemLoader, StrictUndefined

    from .target import hf_config
    from .topology import drafter_config

    spec = ctx.spec
    out = ctx.results / "bench"
    out.mkdir(parents=True, exist_ok=True)
    tpath = ctx.results / "train" / "manifest.json"
    train = read_manifest(tpath, "train")
    expect(train, tpath, {"env": ctx.env_fingerprint, "train": spec.fingerprint("train"),
                          "shape": spec.fingerprint("warmup")})
    bcfg = spec["bench"]
    if bcfg["mode"] == "run":
        from . import train as train_stage

        run_dir = out / "run"
        timed = train_stage.run(ctx, out=run_dir, persist=False,
                                max_steps=bcfg["warmup_steps"] + bcfg["steps"])
        source, metrics = timed, _read_metrics(run_dir / "metrics.jsonl")
        metrics = metrics[bcfg["warmup_steps"]:]
    else:
        source, metrics = train, _read_metrics(ctx.results / "train" / "metrics.jsonl")
    steady = source["steady_state"]

    # FLOPs from configs and the tokens actually processed in the steady-state window
    tcfg, dcfg = hf_config(spec["target"]), drafter_config(spec)
    layers_run = max(dcfg.target_layer_ids) + 1
    skip = len(metrics) - steady["steps"] if steady.get("steps") else 0
    window = metrics[skip:] if metrics else []
    ddtype = torch.float32 if spec["drafter"]["dtype"] == "float32" else torch.bfloat16
    peak = measure_peak_flops(spec["topology"]["drafters"][0], ddtype)
    seconds = steady.get("seconds") or None
    busy, wait = source.get("busy_s", {}), source.get("wait_s", {})
    # share of each target thread's life spent computing, not waiting for work or for room in
    # the queues (train_s also holds the final checkpoint, after the targets are done)
    target_busy = [v / (v + wait.get(k, 0.0)) for k, v in busy.items()
                   if k.startswith("target") and v + wait.get(k, 0.0) > 0]
    n_run = max(1, (source.get("steps") or {}).get("run_now") or steady.get("steps") or 1)
    n_t, n_d = len(spec["topology"]["targets"]), len(spec["topology"]["drafters"])
    drafter_mfu_busy = None
    if window and seconds:
        ds_lengths = _doc_lengths_per_step(ctx, window)
        t_fl = sum(target_flops(tcfg, layers_run, d) for d in ds_lengths)
        # useful = labelled block positions (padded anchor slots are computed but not useful)
        d_fl = sum(drafter_flops_per_step(dcfg, m["tokens"], m["labelled"], m["labelled"])
                   for m in window)
        on_cpu = all(d == "cpu" for d in spec.devices())
        # CPU workers share one socket: the peak is the machine's, not per worker
        t_peak = peak["flops_per_s"] * (1 if on_cpu else n_t)
        d_peak = peak["flops_per_s"] * (1 if on_cpu else n_d)
        target_mfu, drafter_mfu = t_fl / seconds / t_peak, d_fl / seconds / d_peak
        # the drafter's MFU while it computes (a starved drafter idles; that is the target
        # side's share, not the drafter's efficiency): window FLOPs over its busy time there
        d_busy = [v / n_run for k, v in busy.items() if k.startswith("drafter")]
        if d_busy and not on_cpu and sum(d_busy) > 0:
            drafter_mfu_busy = d_fl / (sum(d_busy) / len(d_busy) * len(window)) / d_peak
    else:
        target_mfu = drafter_mfu = None
    drafter_dir = ctx.results / "train" / "drafter"
    dev_eval = spec["topology"]["targets"][0]
    tau = evaluate_tau(spec, drafter_dir, bcfg["eval_prompts"], bcfg["eval_max_new_tokens"],
                       dev_eval)
    report = {
        "spec": spec.name, "mode": bcfg["mode"],
        "tokens_per_s": steady.get("tokens_per_s"),
        "samples_per_s": (sum(m["samples"] for m in window[1:]) / seconds) if window and seconds
        else None,
        "target_mfu": target_mfu, "drafter_mfu": drafter_mfu,
        "drafter_mfu_while_busy": drafter_mfu_busy,
        "mfu_note": ("CPU: all workers share the machine; MFU is against the whole CPU's "
                     "measured fp32 matmul peak" if all(d == "cpu" for d in spec.devices())
                     else "per-GPU peak measured on the first drafter device × GPUs in role"),
        "peak": peak,
        "target_busy_fraction": (sum(target_busy) / len(target_busy)) if target_busy else None,
        "step_time": {"mean_s": steady.get("step_time_s"),
                      "busy_s_per_step": {k: v / n_run for k, v in busy.items()},
                      "wait_s_per_step": {k: v / n_run for k, v in wait.items()},
                      "steps": n_run,
                      "note": "busy: target forward (host-synced) / drafter fwd+bwd+optim "
                              "(CUDA events); wait: for inputs, room in queues, barriers"},
        "time_to_first_step_s": source.get("time_to_first_step_s"),
        "recompiles_after_warmup": source["gate"]["recompiles_after_warmup"],
        "race_errors": source["gate"]["race_errors"],
        "gate_wait_s": source["gate"]["shared_wait_s"] + source["gate"]["exclusive_wait_s"],
        "gate": "on" if source["gate"].get("enabled", True) else "off (DFLASH_GATE=off)",
        "final_loss": source.get("final_loss"),
        "tau": tau.get("tau"), "acceptance": tau,
        "topology": {"targets": spec["topology"]["targets"],
                     "drafters": spec["topology"]["drafters"]},
        "env": {k: ctx.env_manifest.get(k) for k in ("python", "torch", "transformers",
                                                     "triton", "cuda", "driver", "gpus")
                if k in ctx.env_manifest},
        "fingerprints": {"env": ctx.env_fingerprint, "spec_train": spec.fingerprint("train"),
                         "spec_shape": spec.fingerprint("warmup"),
                         "spec_bench": spec.fingerprint("bench")},
        "drafter_dir": str(drafter_dir),
    }
    report["plots"] = _plots(out, metrics, tau)
    atomic_write_json(out / "report.json", report)
    env = Environment(loader=FileSystemLoader(Path(__file__).with_name("templates")),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    md = env.get_template("report.md.j2").render(r=report, fmt=_fmt)
    atomic_write_text(out / "report.md", md)
    print(md, flush=True)
    return report


def _doc_lengths_per_step(ctx, window: list[dict]) -> list[list[int]]:
    from .data import load_dataset

    ds = load_dataset(ctx.spec, ctx.results)
    length = dict(zip(ds.sample_ids, ds.lengths))
    return [[length[s] for s in m["sample_ids"]] for m in window]


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e4 else f"{x:,.0f}"
    return str(x)
