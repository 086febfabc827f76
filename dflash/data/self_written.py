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

Steering (``data.self_written.categories``, default none): each candidate's prefix then starts
with a system turn saying which kind of request the user will make (:data:`CATEGORIES`), the way
Magpie's task-specific pre-query templates (math, code) and distilabel's per-category system
prompts steer the writer. Candidates are spread evenly over the listed categories, in a seeded
order per round (a running count, so the totals over all rounds differ by at most one). The kept
prompt is the user turn alone: its answer is generated under the default system turn, as the
evaluation prompts are. The cues are our own words (a test checks none shares an n-gram with
MT-Bench or HumanEval), and every kept prompt still goes through the caller's decontamination.
The category of every kept prompt is recorded in ``<data>/self_written/categories.json`` (in
kept order) and counted in the report; the data manifest's ``sources.self-written.first_prompt_id``
says where those prompts start among the dataset's ``prompt_id`` s, so
:func:`prompt_categories` maps a dataset row to its category (the bench's τ per category on the
drafter's own training prompts). Unsteered, prefixes, round files and report are as before.
"""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path
from typing import Callable, Sequence

from ..errors import DFlashError
from ..artifacts.manifest import atomic_write_json, fingerprint
from .prompts import Prompt, normalize

SOURCE = "self-written"
_MARK = "\u2063MAGPIE-USER-TURN\u2063"
_RUN = re.compile(r"(.)\1{15}", re.S)
CATEGORIES_FILE = "categories.json"  # the category of each kept prompt, in kept order
FOLDER = "self_written"  # <data>/self_written/: the round files and CATEGORIES_FILE


# data.self_written.categories -> the system turn that steers the writer (MT-Bench's eight
# categories; the schema's enum lists the same names, a test holds them together)
_ASK = "You are a helpful AI assistant. The user will "
CATEGORIES: dict[str, str] = {
    "writing": _ASK + "ask you to write something for them: a story, a poem, an essay, a blog "
               "post, a speech, a letter or an email, often for a given reader, tone or length.",
    "roleplay": _ASK + "ask you to play a part: to act as a character, a professional or a "
                "well-known person, and to answer in that voice.",
    "reasoning": _ASK + "ask you something that needs careful step-by-step reasoning: a logic "
                 "puzzle, a riddle, an ordering or counting question, or a tricky everyday "
                 "problem.",
    "math": _ASK + "ask you to solve a math problem step by step: arithmetic, algebra, "
            "geometry, probability, statistics or a word problem.",
    "coding": _ASK + "ask you a programming question: to write, explain, debug or speed up "
              "code, usually in Python, sometimes in another language.",
    "extraction": _ASK + "paste a piece of text, such as an article, a review, a table or a "
                  "report, and ask you to pull out, summarise, classify or reformat facts "
                  "from it.",
    "stem": _ASK + "ask you a question about science, technology, engineering or medicine, "
            "such as physics, chemistry, biology, computing or the human body.",
    "humanities": _ASK + "ask you a question about history, philosophy, economics, law, "
                  "politics, art, literature or society.",
}


def user_turn_prefix(tokenizer, cue: str | None = None) -> list[int]:
    """The chat template's tokens up to where a user turn's text begins (after a system turn
    holding ``cue`` when given, else the template's default)."""
    messages = ([{"role": "system", "content": cue}] if cue else []) + [
        {"role": "user", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=False)
    except Exception as e:  # a template without a system role raises (jinja's raise_exception)
        raise DFlashError(f"data.self_written.categories: the target's chat template cannot "
                          f"render a system turn ({e})") from None
    if _MARK not in text or (cue and cue not in text):
        raise DFlashError("data.sources self-written: the target's chat template does not "
                          "render a user turn's text verbatim" if _MARK not in text else
                          "data.self_written.categories: the target's chat template does not "
                          "render a system turn's text verbatim")
    return list(tokenizer(text[:text.index(_MARK)], add_special_tokens=False)["input_ids"])


def prefixes(tokenizer, categories: Sequence[str]) -> dict[str | None, list[int]]:
    """Category (None: unsteered) -> its prefix tokens."""
    if not categories:
        return {None: user_turn_prefix(tokenizer)}
    return {c: user_turn_prefix(tokenizer, CATEGORIES[c]) for c in categories}


def assign_categories(categories: Sequence[str], seed: int, rnd: int, start: int,
                      n: int) -> list[str | None]:
    """The categories of round ``rnd``'s ``n`` candidates: round-robin from the running count
    ``start`` (even over all rounds), in a seeded order (so the round that reaches ``count``
    does not stop on the same categories every time)."""
    if not categories:
        return [None] * n
    order = [categories[(start + j) % len(categories)] for j in range(n)]
    random.Random(fingerprint([SOURCE, "categories", seed, rnd])).shuffle(order)
    return order


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


def _round_samples(path: Path, meta: dict, n: int, make: Callable[[], list[list[int]]],
                   report: dict) -> list[list[int]]:
    """A round's raw samples: from its file when made from these settings, else ``make()``
    (written atomically before they are filtered)."""
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("meta") == meta and len(saved["tokens"]) == n:
                report["rounds_reused"] += 1
                return saved["tokens"]
        except (ValueError, KeyError):
            pass
    samples = make()
    atomic_write_json(path, {"meta": meta, "tokens": samples})
    return samples


def _decode(tokenizer, toks: list[int], eos: set[int]) -> tuple[str, bool]:
    """A sampled user turn's text (its end-of-turn token off) and whether it ended."""
    terminated = bool(toks) and toks[-1] in eos
    return tokenizer.decode(toks[:-1] if terminated else toks,
                            skip_special_tokens=False).strip(), terminated


def write_prompts(count: int, *, sample: Callable[[list[list[int]], list[int]], list[list[int]]],
                  tokenizer, eos_ids: Sequence[int], settings, seed: int, ident: str,
                  round_dir: Path, seen: set[str],
                  reject: Callable[[list[dict]], str | None] | None = None,
                  log: Callable[[str], None] = print) -> tuple[list[Prompt], dict]:
    """``count`` target-written prompts (``Prompt.prompt_id`` = order kept) and their report.

    ``sample(prefixes, seeds)`` returns one token list per (prefix, seed) pair (ending at eos
    when the turn ended). ``seen``: normalised texts already taken (updated). ``ident``:
    identity of the model and settings, recorded with each round file. ``reject(messages)``
    may name a further bad kind (prompt too long once rendered, evaluation overlap).
    """
    cats = tuple(settings.categories)
    prefix = prefixes(tokenizer, cats)
    eos = set(int(e) for e in eos_ids)
    specials = [s for s in getattr(tokenizer, "all_special_tokens", []) if len(s) > 1]
    report = {"requested": count, "rounds": 0, "candidates": 0, "rounds_reused": 0,
              "filtered": {}, "duplicates": 0, "kept": 0, "new_tokens": 0}
    per_cat = {c: {"candidates": 0, "kept": 0} for c in cats}
    kept: list[Prompt] = []
    kept_cats: list[str | None] = []
    round_dir.mkdir(parents=True, exist_ok=True)
    for rnd in range(settings.max_rounds):
        if len(kept) >= count:
            break
        factor = settings.oversample
        if report["candidates"]:  # later rounds: size by the keep rate seen so far
            rate = len(kept) / report["candidates"]
            factor = max(factor, 1.2 / max(rate, 0.02))
        n = math.ceil((count - len(kept)) * factor)
        assigned = assign_categories(cats, seed, rnd, report["candidates"], n)
        meta = {"ident": ident, "seed": seed, "round": rnd, "n": n}
        if cats:  # unsteered round files stay as they were
            meta["start"] = report["candidates"]
        samples = _round_samples(
            round_dir / f"round-{rnd:04d}.json", meta, n, report=report,
            make=lambda: sample([prefix[c] for c in assigned],
                                [round_seed(seed, rnd, i) for i in range(n)]))
        report["rounds"] += 1
        report["candidates"] += n
        for c in cats:  # every candidate sampled, like "candidates" (the loop may stop early)
            per_cat[c]["candidates"] += assigned.count(c)
        before = len(kept)
        for i, toks in enumerate(samples):
            report["new_tokens"] += len(toks)
            cat = assigned[i]
            text, terminated = _decode(tokenizer, toks, eos)
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
                               where=f"{SOURCE}:{cat + ':' if cat else ''}round {rnd}:{i}"))
            kept_cats.append(cat)
            if cat is not None:
                per_cat[cat]["kept"] += 1
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
    if cats:
        report["categories"] = per_cat
        atomic_write_json(round_dir / CATEGORIES_FILE, {"categories": kept_cats,
                                                        "counts": per_cat})
    return kept, report


def prompt_categories(data_dir: Path) -> dict[int, str]:
    """``prompt_id`` -> category of every steered self-written prompt of a data stage's folder
    (its ``manifest.json`` and ``self_written/categories.json``); empty when none was steered
    (no categories file) or the manifest predates ``first_prompt_id``."""
    data_dir = Path(data_dir)
    path = data_dir / FOLDER / CATEGORIES_FILE
    if not path.is_file():
        return {}
    try:
        sources = json.loads((data_dir / "manifest.json").read_text()).get("sources") or {}
        cats = json.loads(path.read_text())["categories"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"{data_dir}: unreadable data manifest or {path.name} "
                          f"({type(e).__name__}: {e})") from None
    first = [v.get("first_prompt_id") for k, v in sources.items()
             if k.split("#")[0] == SOURCE and isinstance(v, dict)]
    if not cats or len(first) != 1 or first[0] is None:
        return {}
    return {first[0] + j: c for j, c in enumerate(cats) if c is not None}
