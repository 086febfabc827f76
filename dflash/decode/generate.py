"""The front door to batch generation with the target: :func:`open_generator` gives one object
for either engine (the data stage spreads chunks of prompts over several of them:
:func:`dflash.data.generate.generate_chunks`).

    gen = open_generator("auto", target, slots=256, max_len=512, max_new_tokens=256,
                         temperature=0.0)
    answers = gen.generate(prompt_token_lists, seeds)          # in prompt order

Engines (``data.engine``): ``fast`` (:mod:`dflash.decode.engine`: static KV cache, continuous
batching, a CUDA-graph decode step; every chunk of a worker streams through one continuous
batch) and ``hf`` (:func:`generate_batch`: the HF model's forward with a growing KV cache, one
batch per chunk); ``auto`` takes ``fast`` where it supports the architecture. Sampling
(``temperature > 0``) is seeded per sample (:func:`sample_seed`).

Owns: the engine choice, the hf engine, the two generators. Imports the top-level modules,
``models.target`` and :mod:`dflash.decode.engine`.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Sequence

import torch

from ..errors import DFlashError
from ..artifacts.manifest import fingerprint
from ..models.target import kv_cache
from .engine import Engine, unsupported_reason

ENGINES = ("auto", "hf", "fast")


# ---------------------------------------------------------------------------------------------
# what both engines share, and the hf engine: the HF model's forward with a growing KV cache
# ---------------------------------------------------------------------------------------------
def eos_ids_of(target) -> list[int]:
    ids = set()
    for src in (target.tokenizer.eos_token_id,
                getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    if not ids:
        raise DFlashError("target tokenizer has no eos token: generation could not stop")
    return sorted(ids)


def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                   temperature: float, eos_ids: Sequence[int], pad_id: int,
                   seeds: Sequence[int] | None = None) -> list[list[int]]:
    """Left-padded batched generation with a KV cache; each response ends at eos (inclusive).

    Greedy when ``temperature == 0``; otherwise row ``i`` samples with its own generator seeded
    with ``seeds[i]``.
    """
    device = next(model.parameters()).device
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        attn[i, P - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(list(eos_ids), device=device)
    gens = None
    if temperature > 0:
        gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    cache_kw, cache = kv_cache(model)
    step_ids, step_pos = ids, pos
    with torch.inference_mode():
        for t in range(max_new_tokens):
            res = model(input_ids=step_ids, attention_mask=attn, position_ids=step_pos,
                        use_cache=True, logits_to_keep=1, **{cache_kw: cache})
            logits = res.logits[:, -1].float()
            if gens is None:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.cat([torch.multinomial(probs[i], 1, generator=gens[i])
                                 for i in range(B)])
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            out[:, t] = nxt
            hit = torch.isin(nxt, eos) & ~done
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            done |= hit
            if bool(done.all()):
                break
            step_ids = nxt[:, None]
            step_pos = step_pos[:, -1:] + 1
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], -1)
    out, lengths = out.cpu(), lengths.cpu()
    return [out[i, :int(lengths[i])].tolist() for i in range(B)]


def sample_seed(seed: int, sample_id: int) -> int:
    return int(fingerprint(["sample", seed, sample_id]), 16) & ((1 << 63) - 1)


def resolve_engine(name: str, model) -> str:
    """``auto`` -> ``fast`` where the model is supported, else ``hf``; ``fast`` must be supported.

    On CPU too: the eager fast engine (no compile, no graph) beats the HF loop on the default
    spec (bench/gen_throughput.py; docs/data.md has the figures).
    """
    if name not in ENGINES:
        raise DFlashError(f"data.engine: {name!r} is not one of {', '.join(ENGINES)}")
    if name == "hf":
        return "hf"
    why = unsupported_reason(model)
    if name == "fast" and why:
        raise DFlashError(f"data.engine 'fast' cannot run this target: {why}; use 'hf' or 'auto'")
    return "hf" if why else "fast"


# ---------------------------------------------------------------------------------------------
# one object for both engines
# ---------------------------------------------------------------------------------------------
Chunk = tuple[int, Sequence[Sequence[int]], Sequence[int]]  # (chunk id, prompts, seeds)


class HFGenerator:
    """The ``hf`` engine behind the front door: batches of ``slots`` prompts."""

    engine = "hf"
    setup_seconds = 0.0

    def __init__(self, model, *, slots: int, max_new_tokens: int, temperature: float,
                 eos_ids: Sequence[int], pad_id: int):
        self.model, self.slots, self.max_new = model, slots, max_new_tokens
        self.temperature, self.eos_ids, self.pad_id = temperature, list(eos_ids), pad_id

    def prepare(self) -> None:
        pass

    def generate(self, prompts: Sequence[Sequence[int]],
                 seeds: Sequence[int] | None = None) -> list[list[int]]:
        out: list[list[int]] = []
        for j in range(0, len(prompts), self.slots):
            part = None if seeds is None else seeds[j:j + self.slots]
            out += generate_batch(self.model, prompts[j:j + self.slots], self.max_new,
                                  self.temperature, self.eos_ids, self.pad_id, part)
        return out

    def run_chunks(self, chunks: Iterable[Chunk]) -> Iterator[tuple[int, list, float]]:
        """``(chunk id, answers, start time)`` per chunk, one batch each."""
        for chunk, prompts, seeds in chunks:
            tc = time.time()
            yield chunk, self.generate(prompts, seeds), tc

    def settings(self) -> dict:
        return {}


class FastGenerator:
    """The ``fast`` engine behind the front door: one :class:`Engine` (one compile and
    capture) serves every call; chunks stream through its continuous batch."""

    engine = "fast"

    def __init__(self, model, *, slots: int, max_len: int, max_new_tokens: int,
                 temperature: float, eos_ids: Sequence[int], compile):
        self.eos_ids = list(eos_ids)
        self.eng = Engine(model, slots=slots, max_len=max_len, max_new_tokens=max_new_tokens,
                          eos_ids=self.eos_ids, temperature=temperature, compile=compile)

    @property
    def setup_seconds(self) -> float:
        return self.eng.setup_seconds

    def prepare(self) -> None:
        self.eng.prepare()

    def generate(self, prompts: Sequence[Sequence[int]],
                 seeds: Sequence[int] | None = None) -> list[list[int]]:
        return self.eng.generate(prompts, seeds)

    def run_chunks(self, chunks: Iterable[Chunk]) -> Iterator[tuple[int, list, float]]:
        """``(chunk id, answers, start time)`` as each chunk's last answer is in."""
        open_chunks: dict[int, tuple[int, dict, float]] = {}

        def feed():
            for chunk, prompts, seeds in chunks:
                open_chunks[chunk] = (len(prompts), {}, time.time())
                for i, (p, s) in enumerate(zip(prompts, seeds)):
                    yield (chunk, i), p, s

        for (chunk, i), tokens in self.eng.stream(feed()):
            n, got, tc = open_chunks[chunk]
            got[i] = tokens
            if len(got) == n:
                del open_chunks[chunk]
                yield chunk, [got[k] for k in range(n)], tc

    def settings(self) -> dict:
        return self.eng.settings()


def open_generator(name: str, target, *, slots: int, max_len: int, max_new_tokens: int,
                   temperature: float, compile=None, items: int | None = None):
    """A generator for ``target`` (a loaded :class:`dflash.models.target.Target`) with the
    engine ``name`` (``data.engine``: auto, hf, fast; :func:`resolve_engine`). ``slots``: the hf
    engine's batch, the fast engine's continuous batch (no more than ``items``, the number of
    prompts it will see, when given: idle slots cost steps). ``max_len``: the longest prompt +
    ``max_new_tokens`` (the fast engine's cache). ``compile``: the fast engine's
    (:func:`dflash.data.sources.engine_compile`)."""
    eos = eos_ids_of(target)
    if resolve_engine(name, target.model) == "hf":
        pad = target.tokenizer.pad_token_id
        return HFGenerator(target.model, slots=slots, max_new_tokens=max_new_tokens,
                           temperature=temperature, eos_ids=eos,
                           pad_id=eos[0] if pad is None else pad)
    return FastGenerator(target.model, slots=min(slots, items) if items else slots,
                         max_len=max_len, max_new_tokens=max_new_tokens,
                         temperature=temperature, eos_ids=eos, compile=compile)
