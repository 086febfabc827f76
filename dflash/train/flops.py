"""FLOPs and the peaks they are divided by: dense-matmul FLOP/s measured on the device in the
same run (the MFU denominator), the vendor's datasheet dense peak beside it (the denominator
figures quoted elsewhere use), and the useful FLOPs of the target's forward over packed
documents and of a drafter training step (one counting rule for the bench stage and the bench
scripts: :func:`drafter_useful_flops`)."""
from __future__ import annotations

import time

import torch

from ..models.drafter import head_dim_of


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


def _linear_params(cfg, layers: int) -> int:
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
    return 2 * _linear_params(tcfg, layers_run) * tokens + attn


def drafter_flops_per_step(dcfg, ctx_tokens: int, block_tokens: int, labelled: int) -> float:
    """Training FLOPs of one replica step: the trained layers and fc forward + backward (3×
    forward: input and weight gradients); the frozen lm_head forward + input gradient only (2×:
    no weight gradient; the recomputation of the checkpointed logits in backward is not
    counted, as MFU counts the model's FLOPs, not the recomputed ones)."""
    n_feat = len(dcfg.target_layer_ids)
    trained = (2 * _linear_params(dcfg, dcfg.num_hidden_layers) * block_tokens
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
