"""How long the target's self-written user turns run, per category: the share that ends within
each token cap and what a candidate and an ended turn cost at each cap (issue #35: round 22's
prompt-writing phase spent ~68 % of its new tokens on candidates that never ended within
``data.self_written.max_tokens`` 192; which cap, per category, keeps the turns and drops the
waste?).

    PYTHONPATH=. python -m bench.self_written_lengths --spec specs/smollm2-quality.yaml \
        --per-category 32 --max-tokens 320 --out bench/results/cpu/self_written_lengths/cpu.json

The candidates are the data stage's own (``dflash.data.self_written``'s prefixes and category
order, round 0's seeds, the spec's temperature, its generation engine), drawn once up to
``--max-tokens``: the sampler's draws are seeded per sequence and position, so a turn that ends
by cap c here is one a data stage at ``max_tokens: c`` would have seen end. On the CPU the target
runs in float32; a GPU's bfloat16 draws differ, so the shares are an estimate of the GPU's (the
pooled share at 192 sits beside the GPU data manifest's in the notes).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

from bench.entry import command_line, run, write_result
from dflash.data.self_written import assign_categories, prefixes, round_seed
from dflash.data.sources import engine_compile, tokenizer_for
from dflash.decode.generate import eos_ids_of, open_generator
from dflash.errors import DFlashError
from dflash.models.target import load_target
from dflash.spec.load import load_spec

CAPS = (64, 96, 128, 160, 192, 256, 320, 384, 512)


def draw(spec, per_category: int, max_tokens: int, device: str) -> list[tuple[str, int, bool]]:
    """(category, tokens drawn, ended) of ``per_category`` candidates a category."""
    sw = spec.data.self_written
    cats = tuple(sw.categories)
    if not cats:
        raise DFlashError(f"{spec.name}: data.self_written.categories is empty (no category "
                          "cues to draw under)")
    target = dataclasses.replace(spec.target, dtype="float32" if device == "cpu" else
                                 spec.target.dtype)
    tgt = load_target(target, device, seed=spec.seed)
    prefix = prefixes(tokenizer_for(spec.target.model), cats)
    n = per_category * len(cats)
    assigned = assign_categories(cats, spec.seed, 0, 0, n)  # round-robin: per_category each
    gen = open_generator(spec.data.engine, tgt, slots=min(n, spec.data.gen_batch_size), items=n,
                         max_len=max(map(len, prefix.values())) + max_tokens,
                         max_new_tokens=max_tokens, temperature=sw.temperature,
                         compile=engine_compile(spec, device))
    eos = set(eos_ids_of(tgt))
    out = gen.generate([prefix[c] for c in assigned],
                       [round_seed(spec.seed, 0, i) for i in range(n)])
    return [(c, len(t), bool(t) and t[-1] in eos) for c, t in zip(assigned, out)]


def at_caps(rows: list[tuple[str, int, bool]], max_tokens: int) -> list[dict]:
    """Per cap: the share of candidates that ended by it, the new tokens a candidate costs (a
    turn stops at its end or the cap) and the tokens per ended turn."""
    out = []
    for cap in (c for c in CAPS if c <= max_tokens):
        ended = sum(ok and n <= cap for _, n, ok in rows)
        spent = sum(min(n, cap) for _, n, _ in rows)
        out.append({"cap": cap, "ended_share": round(ended / len(rows), 4),
                    "tokens_per_candidate": round(spent / len(rows), 1),
                    "tokens_per_ended_turn": round(spent / ended, 1) if ended else None})
    return out


def summarise(rows: list[tuple[str, int, bool]], max_tokens: int) -> dict:
    by_cat = {c: [r for r in rows if r[0] == c] for c in dict.fromkeys(r[0] for r in rows)}
    ended_lengths = sorted(n for _, n, ok in rows if ok)
    return {
        "pooled": at_caps(rows, max_tokens),
        "by_category": {c: at_caps(r, max_tokens) for c, r in by_cat.items()},
        "never_ended": dict(Counter(c for c, _, ok in rows if not ok)),
        "ended_length_percentiles": {
            p: ended_lengths[min(len(ended_lengths) - 1, int(p / 100 * len(ended_lengths)))]
            for p in (50, 90, 99)} if ended_lengths else {},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--per-category", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    spec = load_spec(a.spec)
    rows = draw(spec, a.per_category, a.max_tokens, a.device)
    res = {"command": command_line("bench.self_written_lengths", argv), "spec": a.spec,
           "device": a.device, "per_category": a.per_category, "max_tokens": a.max_tokens,
           "temperature": spec.data.self_written.temperature,
           "spec_max_tokens": spec.data.self_written.max_tokens, **summarise(rows, a.max_tokens)}
    for row in res["pooled"]:
        print(row)
    for c, caps in res["by_category"].items():
        print(c, " ".join(f"{r['cap']}:{r['ended_share']:.2f}" for r in caps))
    write_result(a.out, res)
    return 0


if __name__ == "__main__":
    run(main)
