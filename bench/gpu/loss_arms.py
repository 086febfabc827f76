"""The arms of bench/gpu/loss_step.py but its ``graph`` arm: main's drafter loss (the baseline,
copied from 6b503df), the objectives per arm, the loss alone (``head_alone``), the whole drafter
step (``step_whole``), the timer and the profiler. The module docstring there says what each arm
is; ``python -m bench.gpu.loss_step`` runs them.
"""
from __future__ import annotations

import dataclasses
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from bench.gpu import drafter_step
from dflash.models.drafter import DFlashConfig
from dflash.models.dtypes import dtype_of
from dflash.train.anchors import block_loss_weights
from dflash.models.target import target_embeddings
from dflash.train.objective import Objective
from dflash.train.warm import synthetic_row
from dflash.train.workers import buckets, objective

SMOLLM2_135M = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                    bos_token_id=1, eos_token_id=2)


# ---- the baseline: main's drafter_loss (dflash/model.py at 6b503df), unchanged -------------
def _main_chunk_ce_sum(h, w_lm, y, wt, k=None, num_positions: int = 0):
    logits = (h @ w_lm.t()).float()
    total = (torch.nn.functional.cross_entropy(logits, y, reduction="none") * wt).sum()
    if k is None:
        return total
    with torch.no_grad():
        hit = (logits.argmax(-1) == y).float()
        hits = torch.zeros(num_positions, device=h.device).scatter_add_(0, k, hit)
    return total, hits


def main_drafter_loss(hidden, lm_head_weight, labels, weights, chunk_size=2048, positions=None,
                      num_positions=0):
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    w = torch.broadcast_to(weights, labels.shape).reshape(-1).to(torch.float32)
    keep = (y != -100) & (w > 0)
    h, y, w = h[keep], y[keep], w[keep]
    k = torch.broadcast_to(positions, labels.shape).reshape(-1)[keep]
    hits = hidden.new_zeros(num_positions, dtype=torch.float32)
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, y.numel(), chunk_size):
        sl = slice(s, s + chunk_size)
        out, chunk_hits = checkpoint(_main_chunk_ce_sum, h[sl], lm_head_weight, y[sl], w[sl],
                                     k[sl], num_positions, use_reentrant=False)
        hits = hits + chunk_hits
        total = total + out
    return total / w.sum(), hits


def main_objective(obj):
    """The objective with main's loss (the ``main`` arm; no cap existed there)."""
    class Main(Objective):
        def loss(self, hidden, lm_head, blocks, soft=None, row_len=None, chunk=2048, **_):
            B = self.block_size
            k = torch.arange(B, device=hidden.device).repeat(blocks.labels.shape[-1] // B)
            return main_drafter_loss(hidden, lm_head, blocks.labels[None],
                                     block_loss_weights(blocks, self.gamma)[None],
                                     positions=k[None], num_positions=B)

    return Main(**dataclasses.asdict(obj))


# ---- measurements ----------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def time_calls(fn, device: str, iters: int) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls, after two warm-up calls (synced)."""
    for _ in range(2):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / iters


def nohead_objective(obj):
    """The objective with the head taken out (the ``nohead`` arm: the step's remainder, i.e.
    drafter forward + backward + optimizer): a loss that touches every hidden state once."""

    class NoHead(Objective):
        def loss(self, hidden, lm_head, blocks, soft=None, row_len=None, chunk=2048, **_):
            hits = torch.zeros(self.block_size, device=hidden.device)
            return hidden.float().square().mean(), hits

    return NoHead(**dataclasses.asdict(obj))


def arm_objective(obj, arm: str, cap):
    """The objective of an arm: main's loss, no head, or the objective's with eager or compiled
    chunks."""
    if arm == "nohead":
        return nohead_objective(obj)
    if arm == "main":
        return main_objective(dataclasses.replace(obj, head_backend=None))
    return dataclasses.replace(obj, max_position=cap,
                               head_backend="inductor" if arm == "compiled" else None)


def head_alone(spec, device: str, arm: str, cap, iters: int) -> dict:
    """The loss's forward + backward on one bucket's blocks, drafter hidden states random; the
    supervised rows found on the blocks' host copy, as the replica does."""

    cfg = DFlashConfig.of_spec(spec)
    obj = objective(spec, cfg)
    obj = arm_objective(obj, arm, cap)
    L = buckets(spec)[-1]
    row = synthetic_row(L, cfg.vocab_size, seed=3, docs=8)
    host = obj.anchors(row, 5)
    blocks = dataclasses.replace(host, **{f.name: getattr(host, f.name).to(device)
                                          for f in dataclasses.fields(host)
                                          if torch.is_tensor(getattr(host, f.name))})
    dt = dtype_of(spec.drafter.dtype)
    head = target_embeddings(spec.target, spec.seed)[1].to(device, dt)
    hidden = torch.randn(1, blocks.labels.numel(), cfg.hidden_size, device=device,
                         requires_grad=True)

    def step():
        with torch.autocast(device.split(":")[0], dtype=dt, enabled=dt != torch.float32):
            loss, _ = obj.loss(hidden, head, blocks, host=host)
        loss.backward()
        hidden.grad = None

    cuda = device.startswith("cuda")
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    t0 = time.perf_counter()
    step()                                   # the compiled arm compiles here
    _sync(device)
    first_s = time.perf_counter() - t0
    s = time_calls(step, device, iters)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
    n = int(obj.supervised(blocks).sum()) if arm != "main" else int(
        (blocks.labels != -100).sum())
    return {"arm": arm, "max_position": cap, "supervised": n, "ms": round(s * 1e3, 3),
            "peak_extra_mb": round(peak / 2**20, 1), "iters": iters,
            "first_call_s": round(first_s, 2)}


def _optimizer(rep, fused: bool) -> None:
    """AdamW fused (the CUDA default) or foreach (the committed run's), set before any step."""
    for g in rep.opt.param_groups:
        g["fused"], g["foreach"] = (True, False) if fused else (False, True)


def profile_steps(step, device: str, steps: int = 3, top: int = 15) -> dict:
    """The top kernels (CUDA; on CPU the top ops) of ``steps`` whole steps by total time."""

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        _sync(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    tally: dict[str, list] = {}
    for e in prof.events():
        if e.device_type != kind or (not cuda and e.cpu_parent is not None):
            continue  # CPU: top-level ops only, so nothing is counted twice
        t = tally.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.time_range.elapsed_us()
    rows = sorted(tally.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for v in tally.values())
    return {"profile": {
        "what": "cuda kernels" if cuda else "cpu top-level ops", "steps": steps,
        "busy_ms_per_step": round(total / steps / 1e3, 3),
        "launches_per_step": round(sum(v[0] for v in tally.values()) / steps, 1),
        "top": [{"name": k[:160], "calls_per_step": round(c / steps, 1),
                 "ms_per_step": round(us / steps / 1e3, 3),
                 "share": round(us / total, 4) if total else None}
                for k, (c, us) in rows[:top]]}}


def step_whole(spec, device: str, arm: str, cap, steps: int, peak: float | None,
               profile: bool = False) -> dict:
    measure = drafter_step.measure
    prod = arm == "prodgraph"   # the training path with compile.cuda_graph_step: on
    if prod:
        spec = spec.replace(compile={"cuda_graph_step": "on"})
    fused = arm in ("compiled", "nohead", "prodgraph") and device.startswith("cuda")
    reps = []

    def prepare(rep):
        rep.objective = arm_objective(rep.objective, "compiled" if prod else arm, cap)
        _optimizer(rep, fused=fused)
        reps.append(rep)

    def after(step) -> dict:
        try:  # the arm keeps its timing even where the profiler cannot run
            return profile_steps(step, device)
        except Exception as e:  # noqa: BLE001 - recorded in the arm's JSON
            return {"profile": {"error": f"{type(e).__name__}: {e}"[:500]}}

    r = measure(spec, spec.batching.max_anchors, device, steps, peak, prepare=prepare,
                after=after if profile else None)
    if arm == "nohead":  # its FLOPs count the head it does not run: no MFU for it
        r["mfu_while_busy"] = None
    if prod:  # warm_replica captured through DrafterReplica.capture_step (or said why not)
        r["graph_step"], r["graph_records"] = reps[0].graph_step, reps[0].graph_records
        r["captured"] = bool(reps[0].graphs) and all(g is not None
                                                     for g in reps[0].graphs.values())
    return {"arm": arm, "max_position": cap,
            "head_backend": "inductor" if arm in ("compiled", "prodgraph") else None,
            "adamw": "fused" if fused else "foreach", **r}

