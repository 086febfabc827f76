"""The drafter replicas' set-up in the warm-up and train stages, old against new, in one run
(issue #34 item 4: the 8B warm-up's ``replicas_s``, 43.6 s of its 98.9 s cold in round 8,
``bench/results/h200/round8-2026-12-02/lease/warmup_8b_cold__manifest.json``).

* ``old``: the initial state cloned from a fresh seeded drafter, and each replica's drafter
  built on the host (its own random init), moved to the device, then loaded with that state.
* ``new``: :func:`dflash.train.workers.initial_state` (the fresh drafter's tensors, no copy)
  and :func:`dflash.train.replica._drafter_on` (built on the meta device, materialised on the
  device, loaded).

Both arms end with the same weights (checked bit for bit).

    PYTHONPATH=$PWD python -m bench.replica_setup --spec specs/qwen3-8b-1gpu.yaml \\
        --order new,old --out bench/results/cpu/replica_setup_8b_newfirst.json
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from bench.entry import run, write_result
from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.spec.load import load_spec
from dflash.train.replica import _drafter_on
from dflash.train.workers import initial_state


def _old(cfg, seed: int, device: str):
    t = time.perf_counter()
    torch.manual_seed(seed)
    state = {k: v.clone() for k, v in DFlashDrafter(cfg).state_dict().items()}
    t_state = time.perf_counter() - t
    t = time.perf_counter()
    model = DFlashDrafter(cfg).to(device)
    model.load_state_dict(state)
    return state, model, t_state, time.perf_counter() - t


def _new(cfg, seed: int, device: str):
    t = time.perf_counter()
    state = initial_state(cfg, seed)
    t_state = time.perf_counter() - t
    t = time.perf_counter()
    model = _drafter_on(device, cfg, "sdpa", state)
    return state, model, t_state, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="specs/qwen3-8b-1gpu.yaml")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="bench/results/cpu/replica_setup_8b_newfirst.json")
    ap.add_argument("--order", default="new,old", help="arms in this order (the first pays "
                    "the process's first large allocations: run both orders to see it)")
    a = ap.parse_args()
    spec = load_spec(a.spec)
    cfg = DFlashConfig.of_spec(spec)
    arms, weights = {}, {}
    for name in a.order.split(","):
        fn = {"old": _old, "new": _new}[name]
        state, model, t_state, t_model = fn(cfg, spec.seed, a.device)
        weights[name] = model.state_dict()["fc.weight"].cpu().clone(), \
            model.state_dict()["layers.0.mlp.down_proj.weight"].cpu().clone()
        arms[name] = {"initial_state_s": round(t_state, 2), "replica_s": round(t_model, 2),
                      "total_s": round(t_state + t_model, 2)}
        print(f"{name}: initial state {t_state:.1f} s, replica on {a.device} {t_model:.1f} s")
        del state, model
    same = all(torch.equal(x, y) for x, y in zip(weights["old"], weights["new"]))
    doc = {"what": __doc__.split("\n")[0], "command": f"python -m bench.replica_setup --spec "
           f"{a.spec} --order {a.order} --out {a.out}", "spec": a.spec, "device": a.device, "order": a.order,
           "cores": os.cpu_count(), "torch": torch.__version__,
           "drafter": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers,
                       "intermediate": cfg.intermediate_size},
           "arms": arms, "same_weights": same,
           "speedup": round(arms["old"]["total_s"] / max(arms["new"]["total_s"], 1e-9), 2)}
    write_result(a.out, doc)
    print(f"old {arms['old']['total_s']} s -> new {arms['new']['total_s']} s; same weights {same}")
    return 0 if same else 1


if __name__ == "__main__":
    run(main)
