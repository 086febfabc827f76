"""What a decode returns (:class:`Decoded`, one per prompt, from :class:`dflash.decode.speculative.Decoder`)
and the lossless evidence over it: where a speculative answer first differs from plain greedy
decoding (:func:`divergence`) and whether every difference is a floating-point near-tie
(:func:`lossless_evidence`, what the bench report prints). Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

# An emitted token differing from plain greedy decoding is a floating-point near-tie when the
# target's top-2 logit margin there is below this (bf16 logits of magnitude < 32 are spaced
# 0.125 apart; a verify of 16 tokens and 16 one-token steps round a few such steps apart).
NEAR_TIE_EPS = 0.5


@dataclass
class Decoded:
    """One prompt's decode: the tokens (prompt excluded; the first comes from the prefill), the
    verify steps that produced the rest, per step the drafts accepted (before truncation) and
    the tokens emitted, and per token the target's top-2 logit margin where it was picked."""
    tokens: list[int]
    target_forwards: int
    tau: float
    accept_counts: list[int]
    block_lengths: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)


def decoded_of(K: int, gen, steps, toks, margins, acc, lens) -> list[Decoded]:
    """One :class:`Decoded` per sequence from the decoder's buffers read back to the host (per
    sequence: tokens emitted, verify steps, the output and margin rows, the per-step accepted
    drafts and emitted lengths); ``K`` the verify width (anchor + drafts)."""
    res = []
    for i, st in enumerate(steps):
        a = acc[i][:st]
        res.append(Decoded(
            tokens=toks[i][:gen[i]], target_forwards=st,
            tau=sum(lens[i][:st]) / st if st else float("nan"),
            accept_counts=[sum(x > k for x in a) for k in range(K - 1)],
            block_lengths=lens[i][:st], accepted=a, margins=margins[i][:gen[i]]))
    return res


def divergence(spec: Decoded, plain: Decoded) -> dict | None:
    """Where a speculative answer first differs from plain greedy decoding (None if nowhere),
    and the target's top-2 logit margin there in both runs (a near-tie: below
    :data:`NEAR_TIE_EPS`)."""
    a, b = spec.tokens, plain.tokens
    i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        if len(a) == len(b):
            return None
        i = min(len(a), len(b))
    m = [r.margins[i] if i < len(r.margins) else None for r in (plain, spec)]
    near = [x for x in m if x is not None]
    return {"index": i, "greedy_token": b[i] if i < len(b) else None,
            "speculative_token": a[i] if i < len(a) else None,
            "margin": m[0], "speculative_margin": m[1],
            "near_tie": bool(near) and min(near) < NEAR_TIE_EPS}


def lossless_evidence(spec: Sequence[Decoded], plain: Sequence[Decoded], checked: int,
                      mismatches: int) -> dict:
    """The lossless claim and its evidence: every emitted token checked against the argmax of
    the verify logits that produced it, and every difference from plain greedy a near-tie."""
    divs = [d for d in (divergence(s, p) for s, p in zip(spec, plain)) if d is not None]
    identical = len(spec) - len(divs)
    return {"prompts": len(spec), "identical_to_greedy": identical,
            "emitted_checked": checked, "emitted_not_argmax": mismatches,
            "divergences": divs, "epsilon": NEAR_TIE_EPS,
            "max_divergence_margin": max((d["margin"] for d in divs
                                          if d["margin"] is not None), default=None),
            "all_divergences_near_ties": all(d["near_tie"] for d in divs),
            # lossless: nothing emitted that the target did not pick, and every difference from
            # one-token greedy decoding is a floating-point near-tie
            "lossless": mismatches == 0 and all(d["near_tie"] for d in divs)}
