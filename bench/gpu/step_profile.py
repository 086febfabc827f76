"""One step of a prepared :class:`dflash.decode.speculative.Decoder`, measured (decode_speed.py's
``inspect`` hook, run between its compile + capture and its timed decode):

- ``replay_ms``: ms per step of the captured CUDA graph alone (mean of back-to-back replays:
  no prefill, no host sync; on CPU one uncaptured step);
- ``kernels``: what one uncaptured step launches. CUDA: the profiler's device events (kernels,
  memcpy, memset), exactly what the graph replays. CPU (``kernels_cpu_proxy``): inductor's
  kernels (profiled only when ``torch._inductor.config.cpp.enable_kernel_profile`` was set
  before the compile: bench/decode_kernels_cpu.py sets it) plus the top-level ATen ops that
  are not views (about what each launches on CUDA;
  a GEMM, SDPA or topk there may be one to a few kernels);
- ``kernel_device_ms`` and ``top_kernels``: their summed device time and the costliest names.

The extra steps run on the state the warm-up leaves (inactive sequences), like the warm-up's:
they write only cache positions that the next prefill overwrites.
"""
from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dflash.models.graphs import replay_or_run

VIEWS = {"view", "reshape", "transpose", "expand", "slice", "select", "as_strided", "unsqueeze",
         "squeeze", "permute", "t", "alias", "detach", "_unsafe_view", "empty", "empty_strided",
         "lift_fresh", "_reshape_alias", "contiguous", "to", "resolve_conj", "resolve_neg",
         "split", "unbind", "narrow", "result_type", "item", "_local_scalar_dense",
         "broadcast_tensors", "expand_as", "view_as"}


def _sync(dec) -> None:
    if dec.device.type == "cuda":
        torch.cuda.synchronize(dec.device)


def _cpu_kernels(events) -> list:
    """Inductor's kernels and the top-level non-view ATen ops (a CPU stand-in for launches)."""
    out = []
    for e in events:
        if "cpp_fused" in e.name:
            out.append(e)
        elif e.name.startswith("aten::") and e.name[6:] not in VIEWS:
            par = e.cpu_parent
            while par is not None and not par.name.startswith("aten::"):
                par = par.cpu_parent
            if par is None:
                out.append(e)
    return out


def replay_ms(dec, n: int = 50) -> float:
    """ms per step: ``n`` back-to-back replays of the captured step (CPU: 3 eager steps)."""
    n = n if dec._graph is not None else 3
    with torch.inference_mode(), dec.gate.shared():
        replay_or_run(dec._graph, dec._step, 2)
        _sync(dec)
        t = time.perf_counter()
        replay_or_run(dec._graph, dec._step, n)
        _sync(dec)
    return 1e3 * (time.perf_counter() - t) / n


def step_profile(dec, kernels: bool = True) -> dict:
    """``{"replay_ms", "kernels", "kernel_device_ms", "top_kernels"[, "kernels_cpu_proxy"]}``
    of one step of ``dec`` (prepared; ``kernels=False``: replay ms only); a profiler failure
    is recorded, not raised."""
    res: dict = {"replay_ms": round(replay_ms(dec), 4)}
    cuda = dec.device.type == "cuda"
    if not kernels:
        return res
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.inference_mode(), dec.gate.shared(), profile(activities=acts) as prof:
            dec._step()
            _sync(dec)
        evs = prof.events()
        ks = [e for e in evs if e.device_type == DeviceType.CUDA] if cuda else _cpu_kernels(evs)
        by: dict[str, list] = {}
        for e in ks:
            dt = (e.device_time_total if cuda else e.cpu_time_total) or 0.0
            agg = by.setdefault(e.name, [0, 0.0])
            agg[0] += 1
            agg[1] += dt
        res["kernels"] = len(ks)
        res["kernel_device_ms"] = round(sum(v[1] for v in by.values()) / 1e3, 4)
        res["top_kernels"] = [[k[:120], c, round(us, 1)] for k, (c, us) in
                              sorted(by.items(), key=lambda kv: -kv[1][1])[:12]]
        if not cuda:
            res["kernels_cpu_proxy"] = True
    except Exception as e:  # noqa: BLE001 - a count is extra evidence, never the run's end
        res["profile_error"] = f"{type(e).__name__}: {e}"[:300]
    return res
