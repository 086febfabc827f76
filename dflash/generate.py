"""`dflash generate --spec S [--drafter DIR] "prompt"`: try a trained drafter on prompts.

Loads the spec's target and the exported drafter (default ``results/<spec>/train/drafter``),
decodes every prompt target-only and speculatively through the one decoder
(:func:`dflash.eval.serving.pair`: both timed the same way, after the compile and capture), lets
the adaptive policy choose between them at ``--batch`` from their measured step times, and
serves the prompts with the chosen engine, timed. Prints the served answers, τ, tokens/s, the
speed-up, the lossless check (speculative output == target-only greedy output), and what was
served with its measured speed-up over target-only. An entry point like ``validate``: above every room.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .data.prompts import render_prompt
from .decode.generate import eos_ids_of
from .errors import DFlashError
from .eval.serving import pair
from .models.drafter import load_drafter, verify_export
from .models.dtypes import dtype_of
from .models.target import load_target, target_embeddings
from .spec.load import load_spec


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts:
        path = Path(args.prompts)
        try:
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
        except OSError as e:
            raise DFlashError(f"{path}: cannot read the prompts file ({e.strerror})") from None
        lines = [ln for ln in lines if ln]
        if not lines:
            raise DFlashError(f"{path}: the prompts file has no prompt (one per line)")
        prompts += lines
    if not prompts:
        raise DFlashError("generate: no prompt (give one, or --prompts FILE)")
    return prompts


def run(args) -> dict:
    spec = load_spec(args.spec)
    drafter_dir = Path(args.drafter or Path(args.results) / spec.name / "train" / "drafter")
    if not drafter_dir.is_dir():
        raise DFlashError(f"{drafter_dir}: no exported drafter (train the spec first, or pass "
                          f"--drafter DIR)")
    verify_export(drafter_dir)
    device = spec.topology.targets[0]
    prompts = read_prompts(args)
    tgt = load_target(spec.target, device, seed=spec.seed)
    drafter, _ = load_drafter(drafter_dir, device=device, dtype=dtype_of(spec.drafter.dtype))
    drafter.eval()
    embed, head = target_embeddings(spec.target, spec.seed)
    ids = [render_prompt(tgt.tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    got = pair(tgt.model, drafter, ids, min(args.batch, len(ids)), args.max_new_tokens,
               eos_ids_of(tgt), embed=embed.to(device=device, dtype=drafter.dtype),
               lm_head=head.to(device=device, dtype=drafter.dtype))
    lossless = [r.tokens for r in got["results"]] == [r.tokens for r in got["greedy"]]
    served = got["served"]
    for p, r in zip(prompts, got["served_results"]):
        print(f"> {p}\n{tgt.tokenizer.decode(r.tokens, skip_special_tokens=True)}\n")
    why = (got["adaptive"] or {}).get("why", "no step times to decide")
    print(f"τ {got['tau']:.3f} · speculative {got['speculative_tokens_per_s']:.1f} tok/s · "
          f"target-only {got['target_only_tokens_per_s']:.1f} tok/s · speed-up "
          f"{got['speedup']:.2f}× · lossless: {'yes' if lossless else 'NO'} "
          f"(speculative == target-only greedy on {len(prompts)} prompts; {device})")
    print(f"served at batch {got['batch']}: {got['choice']} ({why}) · "
          f"{served['tokens_per_s']:.1f} tok/s, {got['choice_speedup']:.2f}× target-only · "
          f"identical to greedy on {served['identical_to_greedy']}/{len(prompts)} prompts")
    return {**got, "lossless": lossless}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dflash generate", description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="*", help="prompts (each one user turn)")
    ap.add_argument("--spec", required=True, help="specs/<name>.yaml")
    ap.add_argument("--drafter", help="exported drafter folder (default: results/<spec>/train/drafter)")
    ap.add_argument("--prompts", help="a file of prompts, one per line")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded at once (default 1)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    ap.add_argument("--results", default="results", help="results root (default: results)")
    run(ap.parse_args(argv))
    return 0
