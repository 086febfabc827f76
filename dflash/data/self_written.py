"""Prompts written by the target itself ("Magpie", Xu et al. 2024; docs/data.md, "Self-written prompts").

An aligned chat model given only its chat template up to the start of a user turn (for
SmolLM2's ChatML: the default system turn, then ``<|im_start|>user\\n``) writes a plausible user
request and ends it with its end-of-turn token. We sample such turns with the generation engine
(seeded), then keep the ones that pass, in order:

=================  ==========================================================================
``unterminated``   no end-of-turn within ``data.self_written.max_tokens``
``template_leak``  a special token (``<|im_start|>``, ...) inside the text
``too_short``      fewer than ``min_chars`` characters (stripped)
``too_long``       more than ``max_chars`` characters, or the rendered prompt is longer than
                   ``data.max_prompt_tokens`` (the caller's check)
``not_english``    under 95 % printable ASCII, or under half of the non-space characters letters
``repetitive``     a word 3-gram repeated so that under 75 % of them are distinct, or one
                   character 16 times in a row (degenerate loops)
``*_overlap``      shares a word n-gram with MT-Bench or HumanEval (the caller's check)
``duplicate``      the same normalised text as a prompt already kept (from any source)
=================  ==========================================================================

Rounds: round 0 samples ``ceil(count × oversample)`` candidates (seeds derived from the spec
seed, the round and the index) and filters them; each later round samples what is missing
divided by the keep rate seen so far (× 1.2, at least ``oversample``), until ``count`` prompts
are kept; after ``max_rounds`` it fails naming the counts. Every round's raw samples are written
atomically to ``<data>/self_written/round-NNNN.json`` before they are filtered, so a killed data
stage reuses them (on GPU, bf16 logits depend on batch composition, so regenerating would not be
bit-identical); a round made from other settings is regenerated.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Sequence

from ..errors import DFlashError
from ..manifest import atomic_write_json, fingerprint
from .prompts import Prompt, normalize

SOURCE = "self-written"
_MARK = "\u2063MAGPIE-USER-TURN\u2063"
_RUN = re.compile(r"(.)\1{15}", re.S)


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's tokens up to where a user turn's text begins."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise DFlashError("data.sources self-written: the target's chat template does not "
                          "render a user turn's text verbatim")
    return list(tokenizer(text[:text.index(_MARK)], add_special_tokens=False)["input_ids"])


def degenerate(text: str) -> bool:
    if _RUN.search(text):
        return True
    w = text.lower().split()
    grams = [tuple(w[i:i + 3]) for i in range(len(w) - 2)]
    return len(grams) >= 6 and len(set(grams)) / len(grams) < 0.75


def not_english(text: str) -> bool:
    ascii_ok = sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text)
    visible = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    return ascii_ok < 0.95 * len(text) or letters < 0.5 * max(1, len(visible))


def check(text: str, terminated: bool, settings, specials: Sequence[str]) -> str | None:
    """The first filter ``text`` fails (None: keep)."""
    if not terminated:
        return "unterminated"
    if any(s in text for s in specials):
        return "template_leak"
    if len(text) < settings.min_chars:
        return "too_short"
    if len(text) > settings.max_chars:
        return "too_long"
    if not_english(text):
        return "not_english"
    if degenerate(text):
        return "repetitive"
    return None


def round_seed(seed: int, rnd: int, i: int) -> int:
    return int(fingerprint([SOURCE, seed, rnd, i]), 16) & ((1 << 63) - 1)


def write_prompts(count: int, *, sample: Callable[[list[int], list[int]], list[list[int]]],
                  tokenizer, eos_ids: Sequence[int], settings, seed: int, ident: str,
                  round_dir: Path, seen: set[str],
                  reject: Callable[[list[dict]], str | None] | None = None,
                  log: Callable[[str], None] = print) -> tuple[list[Prompt], dict]:
    """``count`` target-written prompts (``Prompt.prompt_id`` = order kept) and their report.

    ``sample(prefix_ids, seeds)`` returns one token list per seed (ending at eos when the
    turn ended). ``seen``: normalised texts already taken (updated). ``ident``: identity of
    the model and settings, recorded with each round file. ``reject(messages)`` may name a
    further bad kind (prompt too long once rendered, evaluation overlap).
    """
    prefix = user_turn_prefix(tokenizer)
    eos = set(int(e) for e in eos_ids)
    specials = [s for s in getattr(tokenizer, "all_special_tokens", []) if len(s) > 1]
    report = {"requested": count, "rounds": 0, "candidates": 0, "rounds_reused": 0,
              "filtered": {}, "duplicates": 0, "kept": 0, "new_tokens": 0}
    kept: list[Prompt] = []
    round_dir.mkdir(parents=True, exist_ok=True)
    for rnd in range(settings.max_rounds):
        if len(kept) >= count:
            break
        factor = settings.oversample
        if report["candidates"]:  # later rounds: size by the keep rate seen so far
            rate = len(kept) / report["candidates"]
            factor = max(factor, 1.2 / max(rate, 0.02))
        n = math.ceil((count - len(kept)) * factor)
        path = round_dir / f"round-{rnd:04d}.json"
        meta = {"ident": ident, "seed": seed, "round": rnd, "n": n}
        samples = None
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
                if saved.get("meta") == meta and len(saved["tokens"]) == n:
                    samples = saved["tokens"]
                    report["rounds_reused"] += 1
            except (ValueError, KeyError):
                samples = None
        if samples is None:
            samples = sample(prefix, [round_seed(seed, rnd, i) for i in range(n)])
            atomic_write_json(path, {"meta": meta, "tokens": samples})
        report["rounds"] += 1
        report["candidates"] += n
        before = len(kept)
        for i, toks in enumerate(samples):
            report["new_tokens"] += len(toks)
            terminated = bool(toks) and toks[-1] in eos
            text = tokenizer.decode(toks[:-1] if terminated else toks,
                                    skip_special_tokens=False).strip()
            why = check(text, terminated, settings, specials)
            messages = [{"role": "user", "content": text}]
            if why is None and reject is not None:
                why = reject(messages)
            if why is None and normalize(text) in seen:
                report["duplicates"] += 1
                continue
            if why is not None:
                report["filtered"][why] = report["filtered"].get(why, 0) + 1
                continue
            seen.add(normalize(text))
            kept.append(Prompt(prompt_id=len(kept), messages=messages,
                               where=f"{SOURCE}:round {rnd}:{i}"))
            if len(kept) == count:
                break
        log(f"self-written round {rnd}: {n} candidates -> {len(kept) - before} kept "
            f"({len(kept)}/{count}); dropped so far {report['filtered']}, "
            f"{report['duplicates']} duplicates")
    report["kept"] = len(kept)
    if len(kept) < count:
        raise DFlashError(
            f"data.self_written: only {len(kept)} of {count} prompts after "
            f"{report['rounds']} rounds ({report['candidates']} candidates; dropped "
            f"{report['filtered']}, {report['duplicates']} duplicates); raise "
            f"data.self_written.max_rounds or .oversample, or loosen .min_chars/.max_chars")
    return kept, report
