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

    python -m bench.gpu.loss_step --spec specs/smollm2-quality.yaml --smollm2-shape \
        --caps none,8 --profile --out loss_step2.json
    python -m bench.gpu.loss_step --spec specs/smollm2-quality.yaml --smollm2-shape \
        --arms compiled,graph --caps none,8 --iters 10 --steps 8 --profile --out loss_step3.json
    python -m bench.gpu.loss_step --smoke --profile --out /tmp/loss_step_smoke.json

``--kinds ce,kd``: every step arm once per ``loss.kind`` (each record says its ``kind``): what
soft labels cost a step, captured (their static buffers) and not, on one machine:

    python -m bench.gpu.loss_step --spec specs/smollm2-quality.yaml --smollm2-shape \
        --arms compiled,graph --caps 8 --kinds ce,kd --out loss_step_kd.json

``--head-chunks 2048,512,256``: every step arm once per ``compile.head_chunk`` (rows per chunk of
the fused head; each record says its ``head_chunk``): whether a chunk's logits kept in L2
makes the captured step faster (round 18's plan, step 4).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.gpu.loss_arms import (SMOLLM2_135M, arm_objective, head_alone, profile_steps, step_whole,
                                 time_calls)
from dflash.models.drafter import DFlashConfig
from dflash.models.dtypes import dtype_of
from dflash.runtime.gate import get_gate
from dflash.runtime.tracing import worker_thread_setup
from dflash.spec.load import load_spec
from dflash.train.flops import drafter_useful_flops, measure_peak_flops
from dflash.train.graph_step import GraphStep, restore, snapshot
from dflash.train.replica import make_optimizer
from dflash.train.warm import synthetic_output, synthetic_row, warm_replica
from dflash.train.workers import buckets, initial_state, make_replicas


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
    # the check's "today" is the uncaptured step: with compile.cuda_graph_step auto (the default
    # since round 5) warm_replica would capture the replica's whole step, and forward_backward
    # would replay it, optimizer included, so its gradient read after would not be the step's
    # (round 18's check read grad_rel 1.84 at every chunk; round 5's, before the default, 0.003)
    spec = spec.replace(compile={"cuda_graph_step": "off"})
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
        r["uncaptured_s_per_step"] = round(time_calls(uncaptured, device, steps), 4)
        step = replayed if gs.graph is not None else uncaptured
        r["captured"] = gs.graph is not None
        r["s_per_step"] = round(time_calls(step, device, steps), 4)
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


def print_step(r: dict, arm: str, cap, chunk: int, kind: str = "ce") -> None:
    """One whole-step record as the log shows it (time, MFU, capture, the top kernels)."""
    print(f"[loss_step] whole step {arm} cap {cap} chunk {chunk} {kind}: {r['s_per_step']} s/step, "
          f"MFU {r['mfu_while_busy']}, compile {r['compile_s']} s", flush=True)
    if arm == "graph":
        print(f"  captured {r['captured']} (uncaptured {r['uncaptured_s_per_step']} "
              f"s/step) {r.get('capture_error', '')}\n  check {r['check']}", flush=True)
    if "busy_ms_per_step" in r.get("profile", {}):
        print(f"  profile: {r['profile']['busy_ms_per_step']} ms busy, "
              f"{r['profile']['launches_per_step']} launches per step", flush=True)
    for k in r.get("profile", {}).get("top", [])[:15]:
        print(f"    {k['ms_per_step']:8.3f} ms {k['calls_per_step']:6.1f}x  "
              f"{k['name'][:100]}", flush=True)


def _whole_steps(a, spec, step_arms, out: dict, save) -> None:
    """Every whole-step arm once per head chunk and loss kind, each record saved as it comes."""
    # today's step first: the first arm also pays the drafter's compile (about a minute on the
    # H200), and a run cut short by its time limit keeps what it measured
    order = {"compiled": 0, "graph": 1, "prodgraph": 2, "nohead": 3, "fused": 4, "main": 5}
    chunks = [int(c) for c in a.head_chunks.split(",") if c] or [spec.compile.head_chunk]
    kinds = [k for k in a.kinds.split(",") if k] or [spec.loss.kind]
    runs = [(arm, cap, c, kind) for kind in kinds for c in chunks
            for arm, cap in sorted(step_arms, key=lambda ac: order[ac[0]])]
    for arm, cap, chunk, kind in runs:
        r = _guarded(step_graph if arm == "graph" else step_whole,
                     spec.replace(compile={"head_chunk": chunk}, loss={"kind": kind}),
                     a.device, arm, cap, a.steps, out["peak"]["flops_per_s"], a.profile)
        r["head_chunk"], r["kind"] = chunk, kind
        if "error" in r:
            print(f"[loss_step] whole step {arm} cap {cap} chunk {chunk} {kind}: "
                  f"{r['error']}", flush=True)
        else:
            print_step(r, arm, cap, chunk, kind)
        out["step"].append(r)
        save()


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
    ap.add_argument("--head-chunks", default="",
                    help="comma list: every step arm once per compile.head_chunk (rows per "
                         "chunk of the head), in this order; default: the spec's")
    ap.add_argument("--kinds", default="",
                    help="comma list: every step arm once per loss.kind (ce, kd, ce+kd), in "
                         "this order; default: the spec's")
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
        _whole_steps(a, spec, step_arms, out, save)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
