"""τ of an exported drafter against its target: simulated on every eval set, real on a subset.

    python -m bench.tau_eval --drafter results/<spec>/train/drafter --spec specs/<spec>.yaml \\
        --device cuda:0 --out bench/results/h200/tau_<spec>.json

Standalone (no Snakemake, no manifests): the target, dtypes and held-out source come from
``--spec`` (its ``target`` and ``data`` sections; ``--results`` names the results folder whose
training dataset the held-out set must avoid, default ``results/<spec name>``); every ``bench``
knob has a flag. Prints one line per set and writes JSON: per set τ (tokens per target forward),
the reference's per-prompt mean, acceptance by block position, the tokens-per-forward
histogram, teacher-forced accuracy by position, τ per MT-Bench category, and for the real
subset the wall-clock tokens/s of target-only vs speculative decoding, the speed-up, lossless
and simulated == real checks, plus the seconds each part took.

``--legacy`` times the previous bench path instead (per-token target decoding + speculative
decoding of every prompt, the drafter recomputing its context each block), for before/after.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.entry import write_result
from dflash.decode.generate import eos_ids_of
from dflash.errors import DFlashError
from dflash.eval.evalsets import load_eval_sets
from dflash.decode.eager import speculative_generate, target_greedy
from dflash.eval.tau import evaluate_sets
from dflash.models.drafter import load_drafter
from dflash.models.dtypes import dtype_of
from dflash.models.target import load_target, target_embeddings
from dflash.spec.load import load_spec

REPO = Path(__file__).resolve().parents[1]


def legacy(tgt, drafter, cfg, embed, head, sets, max_new, eos, device) -> dict:
    """The old bench path: target_greedy + speculative_generate per prompt (now on the
    decoder, eager on CPU)."""
    out = {}
    for es in sets:
        t0 = time.perf_counter()
        prod = fwd = 0
        for p in es.prompts:
            ids = torch.tensor(p, device=device)
            target_greedy(tgt.model, ids, max_new, eos)
            r = speculative_generate(tgt.model, drafter, cfg, embed, head, ids, max_new, eos)
            prod += sum(r.block_lengths)
            fwd += r.target_forwards
        out[es.name] = {"tau": prod / max(1, fwd), "prompts": len(es.prompts),
                        "seconds": round(time.perf_counter() - t0, 3)}
        print(f"[legacy] {es.name}: τ {out[es.name]['tau']:.3f} in {out[es.name]['seconds']}s",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True, help="exported drafter folder (config.json + "
                    "model.safetensors)")
    ap.add_argument("--spec", default=str(REPO / "specs" / "tiny.yaml"),
                    help="spec whose target/data sections to use (default specs/tiny.yaml)")
    ap.add_argument("--results", default=None, help="results/<spec> (held-out exclusions)")
    ap.add_argument("--device", default=None, help="default: cuda:0 if available, else cpu")
    ap.add_argument("--target-dtype", default=None, help="override target.dtype")
    ap.add_argument("--drafter-dtype", default=None, help="override drafter.dtype")
    ap.add_argument("--sets", default="mtbench,humaneval,heldout")
    ap.add_argument("--prompts", type=int, default=80, help="prompts per set")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--real-prompts", type=int, default=8, help="prompts of the first set also "
                    "decoded for real (tokens/s, speed-up, simulated == real)")
    ap.add_argument("--batch-size", type=int, default=80, help="greedy continuation batch")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--legacy", action="store_true", help="time the previous bench path")
    ap.add_argument("--out", default=None, help="JSON output path")
    a = ap.parse_args(argv)

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        spec = load_spec(a.spec)
        if a.target_dtype:
            spec = spec.replace(target={"dtype": a.target_dtype})
        ddtype = a.drafter_dtype or spec.drafter.dtype
        results = Path(a.results) if a.results else REPO / "results" / spec.name
        t0 = time.perf_counter()
        tgt = load_target(spec.target, device, seed=spec.seed)
        drafter, cfg = load_drafter(a.drafter, device=device, dtype=dtype_of(ddtype))
        drafter.eval()
        embed, head = target_embeddings(spec.target, spec.seed)
        sets = load_eval_sets(spec, results, tgt.tokenizer, a.sets.split(","), a.prompts)
        load_s = time.perf_counter() - t0
        eos = eos_ids_of(tgt)
        t0 = time.perf_counter()
        if a.legacy:
            e, h = embed.to(device=device, dtype=drafter.dtype), head.to(device=device,
                                                                         dtype=drafter.dtype)
            per_set = legacy(tgt, drafter, cfg, e, h, sets, a.max_new, eos, device)
        else:
            per_set = evaluate_sets(tgt.model, drafter, embed, head, sets, a.max_new, eos,
                                    a.real_prompts, device, a.batch_size)
        eval_s = time.perf_counter() - t0
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    report = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "drafter": str(a.drafter), "spec": str(a.spec), "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda")
        else platform.processor() or platform.machine(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "target": spec.target.model, "target_dtype": spec.target.dtype,
        "drafter_dtype": ddtype, "block_size": cfg.block_size,
        "drafter_layers": cfg.num_hidden_layers, "max_new_tokens": a.max_new,
        "prompts_per_set": a.prompts, "real_prompts": a.real_prompts, "legacy": a.legacy,
        "load_s": round(load_s, 3), "eval_s": round(eval_s, 3), "sets": per_set,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    print(f"[tau_eval] evaluated in {eval_s:.1f}s (+{load_s:.1f}s loading): " + ", ".join(
        f"{k} τ {v['tau']:.3f}" for k, v in per_set.items() if v.get("tau") is not None))
    if a.out:
        write_result(a.out, report)
        print(f"[tau_eval] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
