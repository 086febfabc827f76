"""The reference harness's τ protocol beside ours (``bench.protocols: [dflash, reference]``).

The reference DFlash benchmark (z-lab ``benchmark.py``) reports MT-Bench with BOTH turns: the
second turn's prompt is the chat template over [user turn 1, the target's own answer to it,
user turn 2] (the answer decoded without special tokens, as that harness does), up to 2,048 new
tokens per turn, and τ as the mean over turns of each turn's accepted tokens per verify step
(the per-prompt mean). Ours (``dflash``): first turns, ``bench.eval_max_new_tokens``, pooled
(total tokens / total verify steps). Both aggregations are reported for both protocols.

The machinery is the simulated one of :mod:`dflash.eval.tau`, batched: the greedy answers of
all first turns in one continuous batch, then of all second turns in another, through the fast
generation engine (:class:`dflash.decode.engine.Engine`, one engine for both turns, compiled and
captured on CUDA) where it runs the target, else the batched HF loop; then features, the
drafter's block at every position and the chain walk over all turns. Every turn's budget is
capped by the target's positions (``max_position_embeddings``); the report counts the turns that
stopped at either cap.

Owns: :func:`evaluate_reference`, :func:`second_turn_prompt`, :func:`reference_questions`.
Imports the top-level modules, ``data`` (the engine, the chat template) and ``eval.tau``.
"""
from __future__ import annotations

import time
from typing import Sequence

from ..data.prompts import render_prompt
from ..runtime.busy import sync
from .budget import budget_hits
from .evalsets import across_categories, mtbench_conversations, user_prompt
from .tau import continuation_engine, greedy_continuations, simulate, summarize


def reference_questions(n: int, seed: int) -> list[dict]:
    """``n`` MT-Bench conversations spread over the categories (all 80 when ``n`` covers them),
    as the first-turn τ set picks its questions."""
    return across_categories(mtbench_conversations(), n, seed)


def second_turn_prompt(tokenizer, turns: Sequence[str], answer: Sequence[int]) -> list[int]:
    """The second turn's prompt: the chat template over [turn 1, the answer (decoded without
    special tokens, so its eos becomes the template's own end of turn), turn 2]."""
    text = tokenizer.decode(list(answer), skip_special_tokens=True)
    return render_prompt(tokenizer, [{"role": "user", "content": turns[0]},
                                     {"role": "assistant", "content": text},
                                     {"role": "user", "content": turns[1]}])


def _engine(model, prompts: Sequence[Sequence[int]], second: Sequence[Sequence[int]],
            max_new: int, eos: Sequence[int], slots: int, max_context: int):
    """One fast engine for both turns: its cache holds the longest second-turn prompt there can
    be (first prompt + a full answer + the second user turn) plus ``max_new``, within the
    target's positions (a longer prompt falls back to the HF loop). None where it cannot run."""
    longest = max(len(p) for p in prompts) + max_new + max(len(s) for s in second) + 16
    return continuation_engine(model, [prompts], max_new, eos, slots,
                               max_len=min(max_context, longest + max_new))


def evaluate_reference(target_model, tokenizer, drafter, embed, lm_head, questions: list[dict],
                       max_new: int, eos: Sequence[int], device: str, batch_size: int = 64,
                       log=print) -> dict:
    """τ under the reference protocol on ``questions`` (both turns each), as a report dict.

    ``embed``/``lm_head`` in the drafter's dtype on ``device`` (as for
    :func:`dflash.eval.tau.simulate`)."""
    t0 = time.perf_counter()
    ctx = int(getattr(target_model.config, "max_position_embeddings", 0) or 0) or None
    p1 = [user_prompt(tokenizer, q["turns"][0]) for q in questions]
    u2 = [user_prompt(tokenizer, q["turns"][1]) for q in questions]
    eng = _engine(target_model, p1, u2, max_new, eos, batch_size, ctx or 1 << 30)
    timings = {}
    t = time.perf_counter()
    a1 = greedy_continuations(target_model, p1, max_new, eos, batch_size, ctx, eng)
    sync(device)
    timings["generate_turn1_s"] = time.perf_counter() - t
    p2 = [second_turn_prompt(tokenizer, q["turns"], a) for q, a in zip(questions, a1)]
    t = time.perf_counter()
    a2 = greedy_continuations(target_model, p2, max_new, eos, batch_size, ctx, eng)
    sync(device)
    timings["generate_turn2_s"] = time.perf_counter() - t
    prompts, answers = p1 + p2, a1 + a2
    sim = simulate(target_model, drafter, embed, lm_head, prompts, max_new, eos,
                   drafter.cfg.target_layer_ids, device, batch_size, continuations=answers,
                   feature_tokens=65536 if str(device).startswith("cuda") else 8192)
    timings.update({k: v for k, v in sim["timings"].items() if k != "generate_s"})
    B, n = drafter.cfg.block_size, len(questions)
    chains = sim["chains"]
    rep = summarize(chains, B)
    hits = budget_hits(prompts, answers, max_new, eos, ctx)
    rep.update({
        "protocol": "reference", "set": "mtbench", "questions": n, "turns": 2,
        "max_new_tokens": max_new, "max_context": ctx,
        "aggregation": "tau_prompt_mean: mean over turns of each turn's tokens per verify "
                       "step (the reference's); tau: pooled, total tokens / total verify steps",
        "generator": "fast engine" if eng is not None else "hf (batched)",
        # slots, cache length, setup (compile + capture) seconds, decode steps, prefills
        "engine": {**eng.settings(), "compile_seconds": eng.stats["compile_seconds"],
                   "capture_seconds": eng.stats.get("capture_seconds", 0.0),
                   "prefill_seconds": round(eng.stats["prefill_seconds"], 3)}
        if eng is not None else None,
        "by_turn": {f"turn{k + 1}": {key: s[key] for key in ("tau", "tau_prompt_mean",
                                                             "prompts", "tokens", "forwards")}
                    for k, s in enumerate((summarize(chains[:n], B), summarize(chains[n:], B)))},
        "hit_cap": hits, "hit_cap_by_turn": {
            "turn1": budget_hits(p1, a1, max_new, eos, ctx),
            "turn2": budget_hits(p2, a2, max_new, eos, ctx)},
        "mean_answer_tokens": sum(map(len, answers)) / len(answers) if answers else None,
        "longest_prompt_tokens": max(map(len, prompts), default=0),
        "timings_s": {k: round(v, 3) for k, v in timings.items()},
    })
    cats: dict[str, list] = {}
    for q, c1, c2 in zip(questions, chains[:n], chains[n:]):
        cats.setdefault(q["category"], []).extend([c1, c2])
    rep["tau_prompt_mean_by_category"] = {c: summarize(v, B)["tau_prompt_mean"]
                                          for c, v in sorted(cats.items())}
    rep["simulated_s"] = round(time.perf_counter() - t0, 3)
    capped = hits["max_new_tokens"] + hits["context"]
    rep["note"] = (f"{2 * n} turns of {n} MT-Bench questions; {capped} stopped at a cap "
                   f"({hits['max_new_tokens']} at {max_new} new tokens, {hits['context']} at "
                   f"the target's {ctx} positions, {hits['no_room']} with no room left)")
    log(f"[bench] τ reference protocol: per-prompt mean {_f(rep['tau_prompt_mean'])}, pooled "
        f"{_f(rep['tau'])} over {2 * n} turns ({rep['note']}; simulated in "
        f"{rep['simulated_s']:.1f}s)")
    return rep


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


__all__ = ["evaluate_reference", "second_turn_prompt", "reference_questions"]
