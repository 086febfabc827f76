"""The drafter's loss on a GPU: main's path against the objective's, alone and inside the whole
drafter step (issue #24 item 1), at a spec's shapes with random weights.

* ``main``: the loss of main at 6b503df (``drafter_loss``, copied below as the baseline):
  chunks of 2048 supervised positions under activation checkpointing, so the frozen head runs
  three times per position (logits, the same logits again in backward, the input gradient) and
  the softmax twice.
* ``fused``: :class:`dflash.train.objective.Objective`'s loss with eager chunks
  (``compile.head_loss: off``): the input gradient is taken in forward while a chunk's logits
  are live (two head matmuls, one softmax); ``loss.max_position`` K also drops every block
  position k > K before the head runs. Its step uses the foreach AdamW of the committed
  ``loss_step.json`` run, so it is that run's arm.
* ``compiled``: the same loss with each chunk one inductor graph (``compile.head_loss`` on, the
  CUDA default), in a step with the fused AdamW (the CUDA default): today's training step.
* ``nohead`` (whole step only): the step with the head and loss replaced by a mean of squares
  over the hidden states, fused AdamW: what the rest of the step (drafter forward + backward,
  mask, optimizer) costs.

* ``prodgraph`` (whole step only): the training path itself with ``compile.cuda_graph_step:
  on``: the replica captures each bucket in ``warm_replica`` (DrafterReplica.capture_step) and
  ``forward_backward`` replays it; ``captured`` says whether it did.
* ``graph`` (whole step only): the replica's whole step (forward, the fixed-shape loss
  ``Objective.static_loss``, backward, clip, fused capturable AdamW, zero) captured once as a
  CUDA graph (:mod:`dflash.train.graph_step`) and replayed, each step copying its row into the
  static buffers first; beside it the same body uncaptured (``uncaptured_s_per_step``). Its
  ``check``: on one row loaded into buffers made for another row, today's step vs the static
  body uncaptured vs a forward+backward graph (loss, grads, hits), then the whole-step
  graph's parameter update vs the uncaptured body's from the same snapshot (relative norms,
  bf16). A failed capture is recorded (``capture_error``) and the uncaptured body timed.

``--profile`` adds, per arm, the top CUDA kernels of the whole step by total time
(torch.profiler over a few steps; on CPU the top ops) and the kernel count per step.
``--smoke`` runs every arm on CPU at tests/specs/micro.yaml's tiny shapes (the script's check).

SmolLM2-135M's shape without its package: ``--smollm2-shape`` writes its public config.json
(vocab 49152 × 576, 30 layers) to a folder and runs the spec with that target, random weights.

    python bench/gpu/loss_step.py --spec specs/smollm2-quality.yaml --smollm2-shape \
        --caps none,8 --profile --out loss_step2.json
    python bench/gpu/loss_step.py --spec specs/smollm2-quality.yaml --smollm2-shape \
        --arms compiled,graph --caps none,8 --iters 10 --steps 8 --profile --out loss_step3.json
    python bench/gpu/loss_step.py --smoke --profile --out /tmp/loss_step_smoke.json
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

from dflash.models.drafter import DFlashConfig
from dflash.models.dtypes import dtype_of
from dflash.models.masks import block_loss_weights
from dflash.models.target import target_embeddings
from dflash.runtime.gate import get_gate
from dflash.runtime.tracing import worker_thread_setup
from dflash.spec import load_spec
from dflash.train.flops import drafter_useful_flops, measure_peak_flops
from dflash.train.graph_step import GraphStep, restore, snapshot
from dflash.train.objective import Objective
from dflash.train.replica import make_optimizer
from dflash.train.warm import synthetic_output, synthetic_row, warm_replica
from dflash.train.workers import buckets, initial_state, make_replicas, objective

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


def _time(fn, device: str, iters: int) -> float:
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
    s = _time(step, device, iters)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
    n = int(obj.supervised(blocks).sum()) if arm != "main" else int(
        (blocks.labels != -100).sum())
    return {"arm": arm, "max_position": cap, "supervised": n, "ms": round(s * 1e3, 3),
            "peak_extra_mb": round(peak / 2**20, 1), "iters": iters,
            "first_call_s": round(first_s, 2)}


def _drafter_step():
    """bench/gpu/drafter_step.py, the module beside this script (no sys.path edit)."""
    spec = importlib.util.spec_from_file_location(
        "drafter_step", Path(__file__).with_name("drafter_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    measure = _drafter_step().measure
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


# ---- the ``graph`` arm: the whole step as one CUDA graph (dflash.train.graph_step) ----------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    d, n = float((a - b).norm()), float(b.norm())
    return d / n if n else d


def _flat(rep) -> torch.Tensor:
    return rep.flat_grad().detach().clone()


def _params(rep) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in rep.params]).clone()


def graph_check(rep, gs_make, row, feats, blocks, cuda: bool) -> dict:
    """The captured step against the uncaptured ones, on one row loaded into buffers made for
    ANOTHER row (so a graph that baked the first row's mask or labels in fails): loss, hits
    and gradients of today's step, the static body uncaptured and (CUDA) the fwd+bwd graph;
    then the whole-step graph's parameter update against the uncaptured body's, from the same
    snapshot. Relative norms; bf16 on the GPU."""
    today = rep.forward_backward(row, feats, blocks)
    g_today = _flat(rep)
    rep.zero_grad()
    gs = gs_make()
    gs.load(row, feats, blocks)
    loss_s, hits_s, _ = gs.body(optimizer=False)
    g_static = _flat(rep)
    rep.zero_grad()
    r = {"supervised": today.labelled,
         "static_vs_today": {"loss_rel": _rel(loss_s, today.loss),
                             "grad_rel": _rel(g_static, g_today),
                             "hits_max_abs": float((hits_s - today.hits).abs().max())}}
    if not cuda:
        return r
    try:
        fb = gs_make()
        fb.capture(optimizer=False)
        fb.load(row, feats, blocks)
        loss_g, hits_g, _ = fb.replay()
    except Exception as e:  # noqa: BLE001 - recorded; the arm goes on (and says so)
        traceback.print_exc()
        r["capture_error"] = f"{type(e).__name__}: {e}"[:2000]
        return r
    g_graph = _flat(rep)
    rep.zero_grad()
    r["graph_vs_today"] = {"loss_rel": _rel(loss_g, today.loss),
                           "grad_rel": _rel(g_graph, g_today),
                           "hits_max_abs": float((hits_g - today.hits).abs().max())}
    return r


# bf16 tolerances, relative norms: the graph replays the uncaptured body's kernels (equal up to
# atomics' order); the static loss sums the same rows in another order and adds zero rows
TOL = {"loss_rel": 1e-2, "grad_rel": 2e-2, "norm_rel": 2e-2, "update_rel": 5e-2,
       "hits_max_abs": 8.0}


def check_ok(check: dict) -> bool:
    """Every comparison in ``check`` within :data:`TOL`."""
    parts = [v for k, v in check.items() if isinstance(v, dict)]
    return all(v[k] <= TOL[k] for v in parts for k in v if k in TOL)


def graph_update_check(rep, gs, row, feats, blocks) -> dict:
    """One whole step from the same snapshot, uncaptured body vs the graph: the parameter
    updates and the pre-clip norms (then the snapshot's state is put back in place)."""
    snap = snapshot(rep)
    p0 = _params(rep)
    gs.load(row, feats, blocks)
    loss_e, _, norm_e = gs.body(optimizer=True)
    d_eager = _params(rep) - p0
    restore(rep, snap)
    loss_r, _, norm_r = gs.replay()
    d_graph = _params(rep) - p0
    restore(rep, snap)
    return {"loss_rel": _rel(loss_r, loss_e), "norm_rel": _rel(norm_r, norm_e),
            "update_rel": _rel(d_graph, d_eager), "update_norm": float(d_eager.norm())}


def _graph_work(spec, device: str, cap, steps: int, peak, profile: bool) -> dict:
    """The graph arm's measurement in a training-like worker thread (see step_graph)."""
    gate, cuda = get_gate(), device.startswith("cuda")
    cfg = DFlashConfig.of_spec(spec)
    L, fdt = buckets(spec)[-1], dtype_of(spec.target.dtype)
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    rep = make_replicas(spec, cfg, initial_state(cfg, spec.seed), total_steps=1000)[0]
    rep.objective = arm_objective(rep.objective, "compiled", cap)
    rep.opt, rep.sched = make_optimizer(rep.params, spec.optim, device, 1000, capturable=True)
    t0 = time.perf_counter()
    warm_replica(rep, L, width, fdt, optimizer_step=False)
    wrow = synthetic_row(L, cfg.vocab_size, seed=11, docs=3)   # the buffers' first row
    wout, wblocks = synthetic_output(rep, wrow, width, fdt, seed=11), rep.anchors(wrow, 11)
    row = synthetic_row(L, cfg.vocab_size, seed=3, docs=8)     # the measured row
    feats, blocks = synthetic_output(rep, row, width, fdt), rep.anchors(row, 5)
    make = lambda: GraphStep(rep, wrow, wout, wblocks)  # noqa: E731
    r: dict = {"arm": "graph", "max_position": cap, "head_backend": rep.objective.head_backend,
               "adamw": "fused capturable" if cuda else "single-tensor, tensor lr"}
    with gate.exclusive("loss_step:graph"):   # may compile (the static loss's first run)
        r["check"] = graph_check(rep, make, row, feats, blocks, cuda)
        gs = make()
        if cuda and "capture_error" not in r["check"]:
            try:
                t1 = time.perf_counter()
                gs.capture(optimizer=True)
                r["capture_s"] = round(time.perf_counter() - t1, 2)
                r["check"]["update"] = graph_update_check(rep, gs, row, feats, blocks)
            except Exception as e:  # noqa: BLE001 - recorded; the uncaptured body is timed
                traceback.print_exc()
                r["capture_error"], gs.graph = f"{type(e).__name__}: {e}"[:2000], None
        elif cuda:
            r["capture_error"] = r["check"]["capture_error"]
    r["compile_s"] = round(time.perf_counter() - t0, 1)
    r["check"]["ok"] = check_ok(r["check"])

    def uncaptured():
        gs.load(row, feats, blocks)
        gs.body(optimizer=True)
        rep.sched.step()

    def replayed():
        gs.load(row, feats, blocks)
        gs.replay()
        rep.sched.step()

    with gate.shared():
        r["uncaptured_s_per_step"] = round(_time(uncaptured, device, steps), 4)
        step = replayed if gs.graph is not None else uncaptured
        r["captured"] = gs.graph is not None
        r["s_per_step"] = round(_time(step, device, steps), 4)
        if profile:
            try:
                r.update(profile_steps(step, device))
            except Exception as e:  # noqa: BLE001 - the arm keeps its timing
                r["profile"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    flops = drafter_useful_flops(cfg, int((row.doc_ids >= 0).sum()), r["check"]["supervised"])
    r.update(bucket=L, num_slots=rep.num_slots(L), steps=steps, flops_per_step=flops,
             labelled=r["check"]["supervised"],
             mfu_while_busy=round(flops / r["s_per_step"] / peak, 4) if peak else None)
    return r


def step_graph(spec, device: str, arm: str, cap, steps: int, peak: float | None,
               profile: bool = False) -> dict:
    """The ``graph`` arm: the replica's whole step (forward, fixed-shape loss, backward, clip,
    capturable fused AdamW, zero) captured once per bucket and replayed, each step copying its
    row into the static buffers first; beside it the same body uncaptured, and the check that
    the graph's loss, grads and update equal the uncaptured step's. CPU (``--smoke``): no
    capture, the static-shape body timed and checked against today's step."""
    spec = spec.replace(topology={"targets": [device], "drafters": [device],
                                  "allow_shared_devices": True})
    with ThreadPoolExecutor(1, initializer=worker_thread_setup) as pool:
        return pool.submit(_graph_work, spec, device, cap, steps, peak, profile).result()


def _guarded(fn, spec, device, arm, cap, *args) -> dict:
    """``fn``'s record, or the arm's error as a record: one failing arm does not cost the
    others their measurement (the GPU gets one call)."""
    try:
        return fn(spec, device, arm, cap, *args)
    except Exception as e:  # noqa: BLE001 - recorded and printed, the next arm runs

        traceback.print_exc()
        return {"arm": arm, "max_position": cap, "error": f"{type(e).__name__}: {e}"[:2000]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec")
    ap.add_argument("--smollm2-shape", action="store_true")
    ap.add_argument("--caps", default="none,8", help="fused and compiled arms: none or K")
    ap.add_argument("--arms", default="main,fused,compiled,graph,prodgraph,nohead",
                    help="comma list of arms")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-step", action="store_true", help="the loss alone only")
    ap.add_argument("--profile", action="store_true", help="top kernels of the step per arm")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, tests/specs/micro.yaml, 2 iterations: the script's own check")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    if a.smoke:
        a.spec, a.device, a.iters, a.steps = "tests/specs/micro.yaml", "cpu", 2, 2
        a.smollm2_shape = False
    if not a.spec:
        ap.error("--spec is required (or --smoke)")
    spec = load_spec(a.spec)
    if a.smoke:  # one drafter on the CPU, a compile the CPU can afford
        spec = spec.replace(topology={"drafters": ["cpu"]})
    if a.smollm2_shape:
        d = Path("/tmp/smollm2-135m-shape")
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(SMOLLM2_135M))
        spec = spec.replace(target={"model": str(d), "init": "random"})
    caps = [None if c == "none" else int(c) for c in a.caps.split(",")]
    names = a.arms.split(",")
    arms = ([("main", None)] if "main" in names else []) + [
        (n, c) for n in ("fused", "compiled") if n in names for c in caps]
    step_arms = (arms + [(n, c) for n in ("graph", "prodgraph") if n in names for c in caps]
                 + ([("nohead", None)] if "nohead" in names else []))
    out = {"spec": spec.name, "target_shape": "smollm2-135m" if a.smollm2_shape else
           spec.target.model, "device": torch.cuda.get_device_name(a.device)
           if a.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "command": " ".join(sys.argv),
           "head_alone": [], "step": []}
    t_start = time.perf_counter()

    def save():
        out["wall_s"] = round(time.perf_counter() - t_start, 1)
        a.out.write_text(json.dumps(out, indent=1) + "\n")

    for arm, cap in arms:
        r = _guarded(head_alone, spec, a.device, arm, cap, a.iters)
        print(f"[loss_step] loss alone {arm} cap {cap}: {r}", flush=True)
        out["head_alone"].append(r)
        save()
    if not a.no_step:
        out["peak"] = (measure_peak_flops(a.device, dtype_of(spec.drafter.dtype))
                       if a.device.startswith("cuda") else {"flops_per_s": None})
        # today's step first: the first arm also pays the drafter's compile (about a minute
        # on the H200), and a run cut short by its time limit keeps what it measured
        order = {"compiled": 0, "graph": 1, "prodgraph": 2, "nohead": 3, "fused": 4, "main": 5}
        for arm, cap in sorted(step_arms, key=lambda ac: order[ac[0]]):
            r = _guarded(step_graph if arm == "graph" else step_whole, spec, a.device, arm,
                         cap, a.steps, out["peak"]["flops_per_s"], a.profile)
            if "error" in r:
                print(f"[loss_step] whole step {arm} cap {cap}: {r['error']}", flush=True)
                out["step"].append(r)
                save()
                continue
            print(f"[loss_step] whole step {arm} cap {cap}: {r['s_per_step']} s/step, MFU "
                  f"{r['mfu_while_busy']}, compile {r['compile_s']} s", flush=True)
            if arm == "graph":
                print(f"  captured {r['captured']} (uncaptured {r['uncaptured_s_per_step']} "
                      f"s/step) {r.get('capture_error', '')}\n  check {r['check']}", flush=True)
            if "busy_ms_per_step" in r.get("profile", {}):
                print(f"  profile: {r['profile']['busy_ms_per_step']} ms busy, "
                      f"{r['profile']['launches_per_step']} launches per step", flush=True)
            for k in r.get("profile", {}).get("top", [])[:15]:
                print(f"    {k['ms_per_step']:8.3f} ms {k['calls_per_step']:6.1f}x  "
                      f"{k['name'][:100]}", flush=True)
            out["step"].append(r)
            save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
