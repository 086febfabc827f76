"""New-token budgets of greedy continuations, and which continuations stopped at one.

A prompt's budget is ``max_new`` capped by the target's positions left after it
(``max_context - len(prompt)``; none left: 0). A continuation that used its whole budget without
ending at eos stopped at a cap: the report counts them, so a τ over truncated answers says so.

Owns: :func:`budgets`, :func:`budget_hits`. Imports nothing of the package.
"""
from __future__ import annotations

from typing import Sequence


def budgets(prompts: Sequence[Sequence[int]], max_new: int,
            max_context: int | None = None) -> list[int]:
    """Each prompt's new-token budget: ``max_new``, capped by the context left after it."""
    return [max(0, min(max_new, max_context - len(p))) if max_context else max_new
            for p in prompts]


def budget_hits(prompts: Sequence[Sequence[int]], conts: Sequence[Sequence[int]], max_new: int,
                eos_ids: Sequence[int], max_context: int | None = None) -> dict:
    """How many continuations stopped at a cap, not at eos: ``max_new_tokens`` (the budget
    ``max_new``) or ``context`` (the target's positions left a smaller budget); ``no_room``:
    prompts that already fill the context (no continuation at all)."""
    eos = {int(e) for e in eos_ids}
    hits = {"max_new_tokens": 0, "context": 0, "no_room": 0}
    for b, c in zip(budgets(prompts, max_new, max_context), conts):
        if b == 0:
            hits["no_room"] += 1
        elif len(c) >= b and (not c or c[-1] not in eos):
            hits["max_new_tokens" if b == max_new else "context"] += 1
    return hits


__all__ = ["budgets", "budget_hits"]
