"""FLOPs and the peaks they are divided by: dense-matmul FLOP/s measured on the device in the
same run (the MFU denominator), the vendor's datasheet dense peak beside it (the denominator
figures quoted elsewhere use), and the useful FLOPs of the target's forward over packed
documents and of a drafter training step (one counting rule for the bench stage and the bench
scripts: :func:`drafter_useful_flops`); and the anchor cost model the bench report's worker
balance recommends ``batching.max_anchors`` from."""
from __future__ import annotations

import time

import torch

from ..models.drafter import head_dim_of
from ..runtime.status import by_role


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


# Dense (no 2:4 sparsity) tensor-core peaks from vendor datasheets, by a substring of
# torch.cuda.get_device_name and the dtype: the second MFU denominator. Only GPUs this
# project has run on; anything else has none (the report says n/a).
DATASHEET_PEAKS = {
    ("H200", "bfloat16"): (989e12, "NVIDIA H200 SXM datasheet: 989 TFLOP/s dense BF16 "
                                   "(1,979 with sparsity)"),
}


def datasheet_peak(device_name: str | None, dtype: str) -> dict | None:
    """The datasheet dense peak for a GPU name and dtype name, or None when not listed."""
    for (gpu, dt), (flops, source) in DATASHEET_PEAKS.items():
        if device_name and gpu in device_name and dt == dtype:
            return {"flops_per_s": flops, "source": source}
    return None


def measure_peak_flops(device: str, dtype: torch.dtype) -> dict:
    """Dense matmul FLOP/s on ``device`` right now (the MFU denominator, measured not quoted),
    with the datasheet peak of that GPU and dtype beside it (``datasheet``, None if unlisted)."""
    n = 8192 if device.startswith("cuda") else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    reps = 20 if device.startswith("cuda") else 3
    per_call = best_seconds_per_call(lambda: a @ b, device, reps)
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    dt = str(dtype).removeprefix("torch.")
    return {"device": device, "dtype": dt, "n": n,
            "flops_per_s": 2 * n ** 3 / per_call, "threads": torch.get_num_threads(),
            "datasheet": datasheet_peak(name, dt)}


def linear_params(cfg, layers: int) -> int:
    """Matmul parameters of ``layers`` Llama/Qwen-style decoder layers."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    hd = head_dim_of(cfg)
    attn = H * hd * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
    return layers * (attn + 3 * H * I)


def target_flops(tcfg, layers_run: int, doc_lengths: list[int]) -> float:
    """Forward FLOPs of the (truncated) target over packed documents: 2·params·tokens plus
    causal attention (QK and AV: 2·2·heads·head_dim per visible key, ~len/2 keys on average)."""
    hd = head_dim_of(tcfg)
    tokens = sum(doc_lengths)
    attn = sum(4 * layers_run * tcfg.num_attention_heads * hd * n * (n + 1) / 2
               for n in doc_lengths)
    return 2 * linear_params(tcfg, layers_run) * tokens + attn


def drafter_flops_per_step(dcfg, ctx_tokens: int, block_tokens: int, labelled: int) -> float:
    """Training FLOPs of one replica step: the trained layers and fc forward + backward (3×
    forward: input and weight gradients); the frozen lm_head forward + input gradient only (2×:
    no weight gradient; the recomputation of the checkpointed logits in backward is not
    counted, as MFU counts the model's FLOPs, not the recomputed ones)."""
    n_feat = len(dcfg.target_layer_ids)
    trained = (2 * linear_params(dcfg, dcfg.num_hidden_layers) * block_tokens
               # K/V projections of the injected context in every layer
               + 2 * ctx_tokens * dcfg.hidden_size * dcfg.head_dim * dcfg.num_key_value_heads
               * 2 * dcfg.num_hidden_layers
               + 2 * ctx_tokens * n_feat * dcfg.hidden_size * dcfg.hidden_size)   # fc
    lm_head = 2 * labelled * dcfg.hidden_size * dcfg.vocab_size
    return 3 * trained + 2 * lm_head


def drafter_useful_flops(dcfg, ctx_tokens: int, labelled: int) -> float:
    """The MFU numerator of a drafter step, the one rule the bench stage and the bench scripts
    share: the context's tokens and the labelled block positions only (padded anchor slots and
    each block's anchor position are computed but not useful)."""
    return drafter_flops_per_step(dcfg, ctx_tokens, labelled, labelled)


def mfu_against_datasheet(peak: dict, **mfu: float | None) -> dict | None:
    """The MFUs ``mfu`` (each over the measured ``peak``) over the datasheet dense peak instead;
    None when the GPU and dtype have no datasheet entry (CPU, unlisted GPUs)."""
    ds = peak.get("datasheet")
    if not ds:
        return None
    scale = peak["flops_per_s"] / ds["flops_per_s"]
    return {"peak_flops_per_s": ds["flops_per_s"], "source": ds["source"],
            **{k: (v * scale if v is not None else None) for k, v in mfu.items()}}


# ---------------------------------------------------------------------------------------------
# the anchor cost model: the worker balance the bench report recommends anchors from
# ---------------------------------------------------------------------------------------------
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
    t_busy = [v / n_run for v in by_role(busy, "target").values()]
    d_busy = [v / n_run for v in by_role(busy, "drafter").values()]
    if not window or not t_busy or not d_busy or min(t_busy + d_busy) <= 0:
        return {"skipped": "no steady-state steps or no busy times recorded"}
    t_busy_s, d_busy_s = sum(t_busy) / len(t_busy), sum(d_busy) / len(d_busy)
    tokens = sum(m["tokens"] for m in window) / len(window)
    labelled = sum(m["labelled"] for m in window) / len(window)
    b, B = spec.batching, dcfg.block_size
    target_rate = tokens / n_t / t_busy_s
    drafter_rate = tokens / n_d / d_busy_s
    idle = idle_fractions(busy, wait, "drafter")
    t_idle = idle_fractions(busy, wait, "target")
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
        "target_side": target_side(spec, t_busy_s, d_busy_s, tokens),
        "projection": {"skipped": "CPU run: its workers share the cores, so it says nothing "
                                  "about GPU splits (run the spec on GPUs for a projection)"}
        if all(d == "cpu" for d in spec.devices()) else {
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


DRAFTER_SPEEDUPS = (1.0, 2.0, 3.0)  # what-ifs: the drafter step this many times faster


def device_bound_tokens_per_s(tokens: float, t_busy: float, d_busy: float, shared: bool) -> float:
    """Target tokens/s the devices allow for steps of ``tokens`` target tokens: on one shared
    GPU the two workers' busy times add up (they take turns on the device); on separate GPUs
    the slower side sets the pace (the pipeline overlaps them)."""
    return tokens / (t_busy + d_busy if shared else max(t_busy, d_busy))


def target_side(spec, t_busy: float, d_busy: float, tokens: float) -> dict:
    """Whether the target is, or becomes, what the step waits on, and what the spec could do
    about it, with figures: ``what_if`` projects tokens/s with the drafter step 1-3× faster
    (device-bound: :func:`device_bound_tokens_per_s`); ``recommend`` lists the fields to change.

    On a shared GPU every target second is a second the drafter cannot use, so the feature
    cache (``features.cache``: the target runs in epoch 0 only) pays as soon as the run has a
    second epoch, whatever the balance; on separate GPUs it pays once the target is the slower
    side. More anchors use a drafter that would otherwise wait for the target."""
    shared = bool(set(spec.topology.targets) & set(spec.topology.drafters)) and \
        any(d != "cpu" for d in spec.devices())
    o, cache = spec.optim, spec.features.cache not in ("off", False)
    epochs = o.epochs if o.max_steps is None else None  # a step budget: epochs unknown here
    what_if = []
    for k in DRAFTER_SPEEDUPS:
        d = d_busy / k
        now = device_bound_tokens_per_s(tokens, t_busy, d, shared)
        cached = tokens / d  # epochs >= 1 read the cache: the drafter alone
        whole = (epochs / (1 / now + (epochs - 1) / cached)) if epochs and epochs > 1 else None
        what_if.append({"drafter_speedup": k, "bound": "target" if t_busy > d else "drafter",
                        "target_share_of_device": t_busy / (t_busy + d) if shared else None,
                        "tokens_per_s": now, "tokens_per_s_epochs_ge_1_with_cache": cached,
                        "tokens_per_s_whole_run_with_cache": whole})
    rec = []
    three = what_if[-1]
    if not cache and (shared or three["bound"] == "target") and (epochs is None or epochs > 1):
        rec.append({"field": "features.cache", "value": "host",
                    "why": f"the target takes {t_busy / (t_busy + d_busy) if shared else t_busy / d_busy:.0%} "
                           + ("of the shared GPU's busy time" if shared else "of the drafter's step")
                           + f"; with the cache epochs >= 1 skip it: "
                           f"{three['tokens_per_s']:,.0f} -> {three['tokens_per_s_epochs_ge_1_with_cache']:,.0f}"
                           f" tok/s there at a {three['drafter_speedup']:g}x faster drafter "
                           "(disk when host memory is short: the run checks the budget first)"})
    if three["bound"] == "target" and not shared:
        rec.append({"field": "batching.max_anchors", "value": "the recommended_max_anchors",
                    "why": "the drafter would wait for the target: more anchors train more "
                           "positions per target token at no wall time"})
    if shared and three["bound"] == "target" and (cache or epochs == 1):
        rec.append({"field": "topology.targets", "value": "a GPU of its own",
                    "why": f"the target ({t_busy * 1e3:.1f} ms/step) outlasts a "
                           f"{three['drafter_speedup']:g}x faster drafter step "
                           f"({d_busy / three['drafter_speedup'] * 1e3:.1f} ms) on one GPU"})
    return {"shared_gpu": shared, "epochs": epochs, "features_cache": cache,
            "bound_now": what_if[0]["bound"], "what_if": what_if, "recommend": rec}


def idle_fractions(busy: dict, wait: dict, role: str) -> list[float]:
    """wait / (busy + wait) of each worker of ``role`` that ran at all."""
    return [wait.get(k, 0.0) / (v + wait.get(k, 0.0)) for k, v in by_role(busy, role).items()
            if v + wait.get(k, 0.0) > 0]


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
