"""Which samples a dataset holds: the prompts of one source or a mix of sources (quotas,
dedup across sources, prompts written by the target itself), rendered in the chat template and
expanded ``data.samples_per_prompt`` times; or seeded synthetic samples for throughput runs.

The data stage (:mod:`dflash.stages.data`) then answers them with the target; this module
decides *what* is answered. docs/data.md has the details.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from transformers import AutoTokenizer

from ..errors import DFlashError
from ..artifacts.manifest import fingerprint
from ..models.target import hf_config, load_target, target_fingerprint, tokenizer_dir
from .check import SELF_WRITTEN, SYNTHETIC, source_quotas
from ..decode.generate import eos_ids_of, open_generator, resolve_engine, sample_seed
from .prompts import BadReport, Prompt, load_prompts, normalize, render_prompt
from .self_written import FOLDER, prefixes, write_prompts


def log(msg: str) -> None:
    """The data stage's console line (this module is its first half)."""
    print(f"[data] {msg}", flush=True)


@dataclass(frozen=True)
class Sample:
    sample_id: int
    prompt_id: int
    sample_index: int
    prompt_ids: tuple[int, ...]


@lru_cache(maxsize=4)
def tokenizer_for(model: str):

    return AutoTokenizer.from_pretrained(tokenizer_dir(model))


def build_samples(spec, tokenizer, data_dir: Path | None = None, *,
                  overlap: Callable[[list[dict], int], str | None]):
    """Load prompts (dropping over-long ones and any that overlap an evaluation set as bad
    records), render, expand. Returns (samples, combined report, prompts, per-source counts).

    ``overlap(messages, n)``: the decontamination check, ``"<set>_overlap"`` or None
    (:func:`dflash.eval.evalsets.eval_overlap`; required: eval/ sits above data/, so the caller
    hands it in).
    """
    d = spec.data
    if d.source == SYNTHETIC:
        samples, report, prompts = synthetic_samples(spec)
        return samples, report, prompts, {SYNTHETIC: {"taken": len(prompts)}}
    rendered: dict[str, list[int]] = {}

    def reject(messages: list[dict]) -> str | None:
        why = overlap(messages, d.decontaminate_ngram)
        if why:
            return why
        key = json.dumps(messages, sort_keys=True)
        ids = rendered.get(key)
        if ids is None:
            ids = rendered[key] = render_prompt(tokenizer, messages)
        if len(ids) > d.max_prompt_tokens:
            return "too_long"
        return None

    if d.source is not None and d.source != SELF_WRITTEN:  # one source: as always
        prompts, report = load_prompts(d.source, d.max_prompts, spec.seed,
                                       d.max_bad_fraction, reject=reject)
        per_source = {d.source: {"requested": d.max_prompts, "taken": len(prompts),
                                    **report.to_dict()}}
    else:
        prompts, report, per_source = _mix(spec, tokenizer, reject, data_dir)
    spp = d.samples_per_prompt
    samples = []
    for p in prompts:
        ids = tuple(rendered[json.dumps(p.messages, sort_keys=True)])
        for k in range(spp):
            samples.append(Sample(p.prompt_id * spp + k, p.prompt_id, k, ids))
    return samples, report, prompts, per_source


def _merge_report(into: BadReport, rep: BadReport) -> None:
    into.total += rep.total
    into.duplicates += rep.duplicates
    for kind, n in rep.counts.items():
        into.counts[kind] = into.counts.get(kind, 0) + n
        ex = into.examples.setdefault(kind, [])
        ex.extend(rep.examples.get(kind, [])[:max(0, 3 - len(ex))])
    if into.first is None:
        into.first = rep.first


def _mix(spec, tokenizer, reject, data_dir: Path | None):
    """Prompts from several sources, deduplicated across them; ids in ``data.sources`` order.

    Files and the chatterbot corpus are read first (each checked against its own
    ``max_bad_fraction``, seeded-shuffled, then the first ``count`` not already taken); the
    self-written prompts come last, so they are written to fill their count after dedup
    against everything else.
    """
    d = spec.data
    quotas = source_quotas(d)
    combined = BadReport(source="mix")
    per_source: dict[str, dict] = {}
    picked: dict[int, list] = {}
    seen: set[str] = set()
    for i, (src, want) in enumerate(quotas):
        if src == SELF_WRITTEN or want == 0:
            continue
        ps, rep = load_prompts(src, 10 ** 9, spec.seed, d.max_bad_fraction, reject=reject)
        take = []
        for p in ps:
            if len(take) == want:
                break
            key = normalize(p.user_text)
            if key in seen:
                rep.duplicates += 1
                continue
            seen.add(key)
            take.append(p)
        if len(take) < want:
            log(f"data.sources[{i}] {src}: {len(take)} prompts available, {want} wanted")
        picked[i] = take
        _merge_report(combined, rep)
        per_source[_name(src, i, per_source)] = {"requested": want, "taken": len(take),
                                                 **rep.to_dict()}
    written: dict[int, dict] = {}
    for i, (src, want) in enumerate(quotas):
        if src == SELF_WRITTEN and want:
            picked[i], rep = _self_written(spec, tokenizer, want, reject, seen, data_dir)
            per_source[_name(src, i, per_source)] = written[i] = rep
    prompts = []
    for i in sorted(picked):
        if i in written:  # where its prompts start: prompt_id -> self_written/categories.json
            written[i]["first_prompt_id"] = len(prompts)
        for p in picked[i]:
            prompts.append(Prompt(prompt_id=len(prompts), messages=p.messages, where=p.where))
    if not prompts:
        raise DFlashError("data.sources: no usable prompts")
    return prompts, combined, per_source


def _name(src: str, i: int, taken: dict) -> str:
    """The manifest key of entry ``i`` (the source; ``source#i`` when listed twice)."""
    return src if src not in taken else f"{src}#{i}"


def _self_written(spec, tokenizer, count: int, reject, seen: set[str], data_dir: Path | None):
    """``count`` prompts written by the target (dflash/data/self_written.py) with the data engine."""
    d = spec.data
    sw = d.self_written
    dev = spec.topology.targets[0]
    t0 = time.time()
    tgt = load_target(spec.target, dev, seed=spec.seed)
    eos = eos_ids_of(tgt)
    engine = resolve_engine(d.engine, tgt.model)
    gen = None

    # the longest prefix (a category cue's system turn) sizes the cache for every round
    longest = max(len(p) for p in prefixes(tokenizer, sw.categories).values())

    def sample(prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        nonlocal gen
        if gen is None:  # one generator (one compile/capture) for every round
            gen = open_generator(engine, tgt, slots=d.gen_batch_size, items=len(seeds),
                                 max_len=longest + sw.max_tokens,
                                 max_new_tokens=sw.max_tokens, temperature=sw.temperature,
                                 compile=engine_compile(spec, dev))
        return gen.generate(prompts, seeds)

    # unsteered: the identity (and so the round files) as before the categories existed
    settings = {k: v for k, v in asdict(sw).items() if k != "categories" or v}
    ident = fingerprint({"target": target_fingerprint(spec.target), "engine": engine,
                         "settings": settings, "eos": eos})
    if data_dir is None:
        raise DFlashError("self-written prompts need the data stage's folder (data_dir)")
    round_dir = Path(data_dir) / FOLDER
    prompts, rep = write_prompts(count, sample=sample, tokenizer=tokenizer, eos_ids=eos,
                                 settings=sw, seed=spec.seed, ident=ident,
                                 round_dir=round_dir, seen=seen, reject=reject, log=log)
    rep.update(engine=engine, seconds=round(time.time() - t0, 2))
    log(f"self-written: {len(prompts)} prompts from {rep['candidates']} candidates in "
         f"{rep['rounds']} round(s), {rep['seconds']}s")
    tgt = gen = None  # free the copy before the answers are generated
    return prompts, rep


def engine_compile(spec, device: str):
    """The fast engine compiles (spec's compile.backend) and captures its step on CUDA only;
    on CPU it runs eager (a compile would cost more than the few hundred steps it saves)."""
    if not device.startswith("cuda"):
        return False
    backend = spec.compile.backend
    return False if backend == "eager" else backend


def _synthetic_vocab_eos(spec) -> tuple[int, int]:

    cfg = hf_config(spec.target)
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 2
    return cfg.vocab_size, eos


def synthetic_samples(spec):
    """Random prompts of seeded length in [max_prompt/2, max_prompt] (no tokenizer, no corpus).

    Only for throughput runs of random-weight targets (spec validation refuses it for a
    pretrained target): generating with a random 32B model would cost minutes of GPU time and
    produce noise all the same.
    """

    d = spec.data
    vocab, _ = _synthetic_vocab_eos(spec)
    samples = []
    for pid in range(d.max_prompts):
        rnd = random.Random(f"synthetic-prompt:{spec.seed}:{pid}")
        n = rnd.randint(max(1, d.max_prompt_tokens // 2), d.max_prompt_tokens)
        ids = tuple(rnd.randrange(5, vocab) for _ in range(n))
        for k in range(d.samples_per_prompt):
            samples.append(Sample(pid * d.samples_per_prompt + k, pid, k, ids))
    return samples, BadReport(source=SYNTHETIC, total=d.max_prompts), list(
        range(d.max_prompts))


def synthetic_responses(spec, samples) -> tuple[list[list[int]], int]:
    """Random responses of seeded length in [max_new/2, max_new], ending with eos."""
    vocab, eos = _synthetic_vocab_eos(spec)
    n = spec.data.max_new_tokens
    out = []
    for s in samples:
        rnd = random.Random(sample_seed(spec.seed, s.sample_id))
        length = rnd.randint(max(1, n // 2), n)
        out.append([rnd.randrange(5, vocab) for _ in range(length - 1)] + [eos])
    return out, eos
