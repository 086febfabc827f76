"""FLOPs and the peak they are measured against: dense-matmul FLOP/s measured on the device in the
same run (the MFU denominator, never a quoted number), and the useful FLOPs of the target's
forward over packed documents and of a drafter training step."""
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
    """Useful training FLOPs of one replica step: the drafter's own layers forward + backward
    (3× forward); the frozen LM head at the supervised positions forward + input gradient (2×
    its forward: no weight gradient, and a recomputation is not useful work)."""
    n_feat = len(dcfg.target_layer_ids)
    fwd = (2 * _linear_params(dcfg, dcfg.num_hidden_layers) * block_tokens
           # K/V projections of the injected context in every layer
           + 2 * ctx_tokens * dcfg.hidden_size * dcfg.head_dim * dcfg.num_key_value_heads * 2
           * dcfg.num_hidden_layers
           + 2 * ctx_tokens * n_feat * dcfg.hidden_size * dcfg.hidden_size)     # fc
    head = 2 * labelled * dcfg.hidden_size * dcfg.vocab_size                   # lm_head
    return 3 * fwd + 2 * head
