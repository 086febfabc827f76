"""Our rows of the decoding speed-up table, rendered from the committed H200 JSON
(bench/gpu/decode_speed.py's output) into README.md and docs/benchmarks.md, so no figure is
copied by hand. The rows sit between the markers ``<!-- ours:decode_speed:begin -->`` and
``<!-- ours:decode_speed:end -->``; everything else in the files is left alone.

    python -m bench.speedup_table                         # print the rows
    python -m bench.speedup_table --write README.md docs/benchmarks.md
    python -m bench.speedup_table --check README.md docs/benchmarks.md   # exit 1 if stale

``--json`` (default bench/results/h200/decode_speed.json) may be given several times (e.g. the
``--verify-tokens 8`` run as well): one row per batch size per file.
"""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from bench import md_block
from bench.entry import run
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]

DEFAULT = REPO / "bench" / "results" / "h200" / "decode_speed.json"
BEGIN, END = "<!-- ours:decode_speed:begin -->", "<!-- ours:decode_speed:end -->"
HEADER = ("| batch | verify tokens | target-only tok/s | speculative tok/s | τ real | speed-up | "
          "choice | speed-up of the choice | HF static tok/s | lossless (checked / not argmax) | "
          "source |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def _num(x, fmt="{:,.1f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _widths(d: dict, r: dict) -> str:
    """The verify tokens of the row's figures, and each verify width's speed-up where the sweep
    timed several (``widths``, bench.decode_widths; older JSON has none)."""
    full = d.get("verify_tokens", "n/a")
    if not r.get("widths"):
        return str(full)
    return f"{full} (" + ", ".join(f"{w['width']}: {_num(w.get('speedup'), '{:.2f}×')}"
                                   for w in r["widths"]) + ")"


def rows(path: Path) -> list[str]:
    """One markdown row per batch size of one decode_speed.json."""
    try:
        d = json.loads(path.read_text())
        batches = d["batches"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"{path}: not a decode_speed.json ({type(e).__name__}: {e})") from None
    rel = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    out = []
    for r in batches:
        ev = r.get("lossless_evidence") or {}
        hf = (r.get("hf_static") or {}).get("tokens_per_s")
        out.append(
            f"| {r['batch']} | {_widths(d, r)} | "
            f"{_num(r.get('target_only_tokens_per_s'))} | "
            f"{_num(r.get('speculative_tokens_per_s'))} | {_num(r.get('tau'), '{:.3f}')} | "
            f"**{_num(r.get('speedup'), '{:.2f}')}×** | {r.get('choice', 'n/a')} | "
            f"{_num(r.get('choice_speedup'), '{:.2f}×')} | {_num(hf)} | "
            f"{ev.get('lossless')} ({ev.get('emitted_checked')} / "
            f"{ev.get('emitted_not_argmax')}) | `{rel}` |")
    for sk in d.get("skipped") or []:  # a batch size the run's --budget-s left out
        out.append(f"| {sk.get('batch')} | {d.get('verify_tokens', 'n/a')} | not measured: "
                   f"{sk.get('reason')} | | | | | | | | `{rel}` |")
    return out


def render(paths: list[Path]) -> str:
    return "\n".join([HEADER] + [row for p in paths for row in rows(p)])


splice = partial(md_block.splice, begin=BEGIN, end=END)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="append", type=Path, help=f"default {DEFAULT}")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", nargs="+", type=Path, metavar="MD")
    g.add_argument("--check", nargs="+", type=Path, metavar="MD")
    a = ap.parse_args(argv)
    table = render(a.json or [DEFAULT])
    if not (a.write or a.check):
        print(table)
        return 0
    return md_block.write_or_check(a.write or a.check, table, begin=BEGIN, end=END,
                                   write=bool(a.write))


if __name__ == "__main__":
    run(main)
