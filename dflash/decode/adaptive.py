"""Speculate or not, per batch size, from measured step costs (issue #36 item 3: never slower
than target-only). Pure arithmetic, no torch: the serving sweep measures and records, this decides.

The rule. A verify of width ``L`` (anchor + ``L - 1`` drafts) emits, per sequence, ``1 + j``
tokens where ``j`` is the number of leading drafts accepted. With ``a[k]`` the share of blocks
whose drafts ``1..k+1`` were all accepted (cumulative, ``accept_rate_by_position``), the mean is
``E(L) = 1 + sum(a[:L-1])``. A wave of ``batch`` sequences lasts as long as its slowest one, so
the mean alone over-promises (H200, batch 64: mean τ / step ratio says 1.13×, 0.90× measured).
The wave model: a sequence needs ``n`` tokens in ``s ≈ n / E`` steps with standard deviation
``σ_s = sqrt(n · Var / E³)`` (``Var`` the per-step token variance of the same distribution), and
the slowest of ``batch`` such takes about ``s + σ_s · sqrt(2 ln batch)`` steps (the usual bound on
the maximum of ``batch`` normals). Its tokens per step ``n / that`` is what a wave delivers.
Expected tok/s = ``batch × tokens per step / step_ms``; speculation is chosen only where its best
width beats target-only by more than ``margin``.

Where a wave of the same prompts was decoded already, its realized tokens per step and per
sequence (``tokens_per_step``) replace the model: prompts differ in τ and in length far more
than i.i.d. blocks do, and a wave waits for its slowest sequence. On the H200 (round 7, batch
16) the model promised 1.93 tokens a step where the wave realized 1.34, and 1.30× where the
decode measured 0.93×.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..errors import DFlashError

MARGIN = 0.1          # speculation must promise > 10 % over target-only to be chosen
NEW_TOKENS = 256      # the bench's new tokens per answer: the wave model's n


def _shares(accept_by_position: Sequence[float | None], width: int) -> list[float]:
    """P(tokens per step = 1 + j) for j = 0 .. width-1 from the cumulative accept shares."""
    a = [1.0] + [float(x or 0.0) for x in accept_by_position[:max(0, width - 1)]]
    a += [0.0] * (width - len(a))
    return [a[j] - (a[j + 1] if j + 1 < width else 0.0) for j in range(width)]


def expected_tokens(accept_by_position: Sequence[float | None], width: int) -> float:
    """``E(L) = 1 + sum of the first L - 1 cumulative accept shares``; width 0 (target-only) and
    1 emit one token a step."""
    return 1.0 + sum(float(x or 0.0) for x in accept_by_position[:max(0, width - 1)])


def wave_tokens(accept_by_position: Sequence[float | None], width: int, batch: int,
                new_tokens: int = NEW_TOKENS) -> float:
    """Tokens per step a wave of ``batch`` sequences delivers per sequence (module docstring):
    ``E(L)`` at batch 1, less as the slowest of a larger wave sets its length."""
    e = expected_tokens(accept_by_position, width)
    if width <= 1 or batch <= 1 or new_tokens <= 0:
        return e
    p = _shares(accept_by_position, width)
    var = max(0.0, sum(q * (1 + j) ** 2 for j, q in enumerate(p)) - e * e)
    steps = new_tokens / e
    slowest = steps + math.sqrt(new_tokens * var / e ** 3) * math.sqrt(2 * math.log(batch))
    return new_tokens / slowest


def choose(batch: int, step_ms: Mapping[int, float], accept_by_position: Sequence[float | None],
           margin: float = MARGIN, new_tokens: int = NEW_TOKENS,
           tokens_per_step: Mapping[int, float] | None = None) -> dict:
    """The decision record at one batch size. ``step_ms``: measured ms per step by verify width,
    0 = target-only (required). ``tokens_per_step``: by width, the tokens per step and sequence a
    decoded wave realized (replaces the wave model for that width). Returns ``{batch, margin,
    candidates: [{width, step_ms, expected_tokens_per_step, expected_tok_s, source}], choice,
    why}``, ``choice`` a width (0 = target-only)."""
    if 0 not in step_ms or not step_ms[0] or step_ms[0] <= 0:
        raise DFlashError(f"adaptive choice at batch {batch}: step_ms has no target-only (width 0) "
                          f"time: {dict(step_ms)}")
    cands = []
    for w in sorted(step_ms):
        ms = step_ms[w]
        if ms is None or ms <= 0:
            continue
        measured = (tokens_per_step or {}).get(w)
        e = measured if measured else wave_tokens(accept_by_position, w, batch, new_tokens)
        cands.append({"width": w, "step_ms": ms, "expected_tokens_per_step": round(e, 4),
                      "expected_tok_s": batch * e / ms * 1e3,
                      "source": "decoded wave" if measured else "wave model"})
    base = cands[0]
    best = max((c for c in cands if c["width"] > 0), key=lambda c: c["expected_tok_s"],
               default=None)
    gain = best["expected_tok_s"] / base["expected_tok_s"] if best else None
    if best is not None and gain > 1 + margin:
        choice, why = best["width"], (f"width {best['width']} promises {gain:.2f}× target-only "
                                      f"(> 1 + margin {margin})")
    else:
        choice = 0
        why = ("no speculative step time measured" if best is None else
               f"best width {best['width']} promises {gain:.2f}× target-only, "
               f"not > 1 + margin {margin}: target-only")
    return {"batch": batch, "margin": margin, "new_tokens": new_tokens, "candidates": cands,
            "choice": choice, "expected_gain": gain, "why": why}


__all__ = ["MARGIN", "NEW_TOKENS", "expected_tokens", "wave_tokens", "choose"]
