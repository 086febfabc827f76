"""The spread of a τ measured on few prompts: a 95 % interval by the percentile bootstrap over
prompts. Standard library only.

A τ here is pooled (token-weighted): Σ tokens / Σ verify forwards over all prompts. Prompts are
the unit that varies (one long easy answer moves τ a lot), so the bootstrap resamples whole
prompts with replacement and recomputes the pooled ratio: no normality assumed, and the
ratio's weighting by forwards is kept. With 8 prompts the interval is wide; that is the point.
Deterministic: a fixed seed, :data:`RESAMPLES` resamples.
"""
from __future__ import annotations

import random
from typing import Sequence

RESAMPLES = 2000
METHOD = (f"percentile bootstrap over prompts of the pooled τ, {RESAMPLES} resamples, seed 0")


def _pooled(tokens: Sequence[float], forwards: Sequence[float]) -> float | None:
    f = sum(forwards)
    return sum(tokens) / f if f else None


def pooled_interval(tokens: Sequence[float], forwards: Sequence[float],
                    seed: int = 0) -> dict:
    """``{"tau", "ci95", "prompts", "method"}`` for per-prompt token and forward counts:
    ``tau`` = Σ tokens / Σ forwards; ``ci95`` = [lo, hi] (None below 2 prompts with forwards)."""
    pairs = [(t, f) for t, f in zip(tokens, forwards) if f]
    tau = _pooled([t for t, _ in pairs], [f for _, f in pairs])
    ci = None
    if len(pairs) >= 2:
        rng = random.Random(seed)
        n = len(pairs)
        stats = []
        for _ in range(RESAMPLES):
            pick = [pairs[rng.randrange(n)] for _ in range(n)]
            stats.append(sum(t for t, _ in pick) / sum(f for _, f in pick))
        stats.sort()
        ci = [stats[int(0.025 * (RESAMPLES - 1))], stats[int(0.975 * (RESAMPLES - 1))]]
    return {"tau": tau, "ci95": ci, "prompts": len(pairs), "method": METHOD}


def tau_interval(lengths: Sequence[Sequence[int]], seed: int = 0) -> dict:
    """:func:`pooled_interval` of per-prompt tokens-per-step lists (one entry per verify)."""
    return pooled_interval([sum(x) for x in lengths], [len(x) for x in lengths], seed)


def fmt(d: dict | None, digits: int = 3) -> str:
    """``τ [lo, hi]`` for a report line ("n/a" without a τ; the τ alone without an interval)."""
    if not d or d.get("tau") is None:
        return "n/a"
    if not d.get("ci95"):
        return f"{d['tau']:.{digits}f}"
    lo, hi = d["ci95"]
    return f"{d['tau']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
