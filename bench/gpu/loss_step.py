"""The drafter's loss on a GPU: main's path against the objective's, alone and inside the whole
drafter step (issue #24 item 1), at a spec's shapes with random weights.

* ``main``: the loss of main at 6b503df (``drafter_loss``, copied below as the baseline):
  chunks of 2048 supervised positions under activation checkpointing, so the frozen head runs
  three times per position (logits, the same logits again in backward, the input gradient) and
  the softmax twice.
* ``fused``: :class:`dflash.train.objective.Objective`'s loss: the input gradient is taken in
  forward while a chunk's logits are live (two head matmuls, one softmax);
  ``loss.max_position`` K also drops every block position k > K before the head runs.

SmolLM2-135M's shape without its package: ``--smollm2-shape`` writes its public config.json
(vocab 49152 × 576, 30 layers) to a folder and runs the spec with that target, random weights.

    python bench/gpu/loss_step.py --spec specs/smollm2-quality.yaml --smollm2-shape \
        --caps none,8 --out loss_step.json
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from dflash.models.dtypes import dtype_of
from dflash.models.masks import block_loss_weights
from dflash.models.target import target_embeddings
from dflash.spec import load_spec
from dflash.train.flops import measure_peak_flops
from dflash.train.objective import Objective
from dflash.train.warm import synthetic_row
from dflash.train.workers import buckets, drafter_config, objective

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
        def loss(self, hidden, lm_head, blocks, soft=None, row_len=None, chunk=2048):
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


def head_alone(spec, device: str, arm: str, cap, iters: int) -> dict:
    """The loss's forward + backward on one bucket's blocks, drafter hidden states random."""
    cfg = drafter_config(spec)
    obj = objective(spec, cfg)
    obj = main_objective(obj) if arm == "main" else dataclasses.replace(obj, max_position=cap)
    L = buckets(spec)[-1]
    row = synthetic_row(L, cfg.vocab_size, seed=3, docs=8)
    blocks = obj.anchors(row, 5)
    blocks = dataclasses.replace(blocks, **{f.name: getattr(blocks, f.name).to(device)
                                            for f in dataclasses.fields(blocks)
                                            if torch.is_tensor(getattr(blocks, f.name))})
    dt = dtype_of(spec.drafter.dtype)
    head = target_embeddings(spec.target, spec.seed)[1].to(device, dt)
    hidden = torch.randn(1, blocks.labels.numel(), cfg.hidden_size, device=device,
                         requires_grad=True)

    def step():
        with torch.autocast(device.split(":")[0], dtype=dt, enabled=dt != torch.float32):
            loss, _ = obj.loss(hidden, head, blocks)
        loss.backward()
        hidden.grad = None

    cuda = device.startswith("cuda")
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    s = _time(step, device, iters)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else 0
    n = int(obj.supervised(blocks).sum()) if arm != "main" else int(
        (blocks.labels != -100).sum())
    return {"arm": arm, "max_position": cap, "supervised": n, "ms": round(s * 1e3, 3),
            "peak_extra_mb": round(peak / 2**20, 1), "iters": iters}


def _drafter_step():
    """bench/gpu/drafter_step.py, the module beside this script (no sys.path edit)."""
    spec = importlib.util.spec_from_file_location(
        "drafter_step", Path(__file__).with_name("drafter_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def step_whole(spec, device: str, arm: str, cap, steps: int, peak: float | None) -> dict:
    measure = _drafter_step().measure

    def prepare(rep):
        rep.objective = (main_objective(rep.objective) if arm == "main"
                         else dataclasses.replace(rep.objective, max_position=cap))

    r = measure(spec, spec.batching.max_anchors, device, steps, peak, prepare=prepare)
    return {"arm": arm, "max_position": cap, **r}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--smollm2-shape", action="store_true")
    ap.add_argument("--caps", default="none,8", help="fused arms: none or K, comma list")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-step", action="store_true", help="the loss alone only")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    spec = load_spec(a.spec)
    if a.smollm2_shape:
        d = Path("/tmp/smollm2-135m-shape")
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(SMOLLM2_135M))
        spec = spec.replace(target={"model": str(d), "init": "random"})
    arms = [("main", None)] + [("fused", None if c == "none" else int(c))
                               for c in a.caps.split(",")]
    out = {"spec": spec.name, "target_shape": "smollm2-135m" if a.smollm2_shape else
           spec.target.model, "device": torch.cuda.get_device_name(a.device)
           if a.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "head_alone": [], "step": []}

    def save():
        a.out.write_text(json.dumps(out, indent=1) + "\n")

    for arm, cap in arms:
        r = head_alone(spec, a.device, arm, cap, a.iters)
        print(f"[loss_step] loss alone {arm} cap {cap}: {r}", flush=True)
        out["head_alone"].append(r)
        save()
    if not a.no_step:
        out["peak"] = (measure_peak_flops(a.device, dtype_of(spec.drafter.dtype))
                       if a.device.startswith("cuda") else {"flops_per_s": None})
        for arm, cap in arms:
            r = step_whole(spec, a.device, arm, cap, a.steps, out["peak"]["flops_per_s"])
            print(f"[loss_step] whole step {arm} cap {cap}: {r['s_per_step']} s/step, MFU "
                  f"{r['mfu_while_busy']}, compile {r['compile_s']} s", flush=True)
            out["step"].append(r)
            save()
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
