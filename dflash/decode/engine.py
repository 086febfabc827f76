"""The fast generation engine: exact generation with the target, a static per-slot KV cache,
continuous batching, and a decode step captured once as a CUDA graph. Callers open it through
the front door, :func:`dflash.decode.generate.open_generator` (which also serves the ``hf``
engine); used alone:

    from dflash.decode.engine import Engine
    eng = Engine(model, slots=1024, max_len=512, max_new_tokens=256, eos_ids=[2])
    answers = eng.generate(prompt_token_lists, seeds=None)      # greedy; list of token lists
    for key, tokens in eng.stream(((k, ids, seed) for ...)):   # completion order
        ...

Why not HF ``generate``: on an H200 it makes 8.8K new tokens/s for SmolLM2-135M at batch 256 (33K
with its static cache + compile), because it pads finished answers until the longest one in the
batch is done and, with the static cache, attends over the whole cache (docs/design.md §7).

How (the model's own modules do the math; only the attention + cache glue is written here):

* **Slots.** ``slots`` sequences decode at once. Each slot owns a row of a static KV cache sized
  to ``max_len`` (longest prompt + ``max_new_tokens``, rounded up) and its own position. A decode
  step feeds every slot its last token at its own position, writes that token's K/V into the
  slot's row and attends over the row with a per-slot length mask.
* **Continuous batching.** A finished answer frees its slot; waiting prompts are prefilled in
  groups (right-padded, causal attention) straight into free slots, and their first token is
  picked from the prefill's logits. No answer waits for another.
* **One captured step.** On CUDA the per-layer pieces are ``torch.compile``-d once (regional
  compilation, :mod:`dflash.models.layers`: the same code serves every layer) and the whole
  decode step — embedding, every layer, lm_head, token pick, state update — is captured once
  as a CUDA graph and replayed;
  the host syncs only every ``sync_every`` steps to harvest finished answers. Prefills run in
  fixed shapes (``prefill_batch`` rows × a multiple of 32 tokens; unused rows write to a spare
  cache row), each length captured once too (:mod:`dflash.decode.prefill` says why). Compile and
  capture run under the compile gate's exclusive side (:mod:`dflash.runtime.gate`), replays under its
  shared side.

Exactness: greedy answers are HF greedy answers (``tests/test_generate.py`` checks them prompt by
prompt against ``model.generate(do_sample=False)``), up to floating-point summation order, which
can only matter at an exact logit tie.

Sampling (``temperature > 0``): counter-based Gumbel-max, :mod:`dflash.decode.sampling`.

Architectures: Llama-family decoders whose layers are ``input_layernorm → self_attn (q/k/v/o
projections, optional q_norm/k_norm as in Qwen3) → post_attention_layernorm → mlp`` with
full attention (``llama``, ``qwen2``, ``qwen3``); :func:`unsupported_reason` says why another
model is not, and the ``hf`` engine (:func:`dflash.decode.generate.generate_batch`) serves it.

Owns: :class:`Engine` (the decode and prefill math, slot scheduling), :func:`unsupported_reason`.
Imports the top-level modules, ``models.layers``, ``runtime.gate``, :mod:`dflash.decode.static`
(the static KV cache and the compile / capture / replay cycle it shares with the speculative
decoder), :mod:`dflash.decode.sampling` (the step's math and its sampling) and
:mod:`dflash.decode.prefill` (the prefill's shapes, buffers, graphs and host packing).
"""
from __future__ import annotations

import time
from typing import Any, Hashable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ..errors import DFlashError
from ..models.layers import (
    SUPPORTED_MODEL_TYPES,  # noqa: F401 (re-exported)
    compile_region,
    rope_of,
)
from ..models.layers import out_mlp as _out_mlp
from ..models.layers import qkv as _qkv
from ..models.layers import unsupported_reason as _layers_unsupported
from ..runtime.gate import get_gate
from .sampling import M32, DECODE_ATTENTION, mix32, pick_token, seed_keys
from .prefill import Prefill
from .static import CapturedStep, TargetCache, round_up



def unsupported_reason(model) -> str | None:
    """Why the fast engine cannot run ``model`` (None when it can)."""
    why = _layers_unsupported(model)
    if why:
        return why
    if not hasattr(model, "lm_head"):
        return "no lm_head (a truncated target cannot generate)"
    return None



class Engine:
    """Continuous-batching generation for one model on one device; reusable across calls.

    ``slots``: sequences decoded at once. ``max_len``: longest prompt + ``max_new_tokens`` the
    cache must hold. ``compile`` / ``cuda_graph``: default on for CUDA, off for CPU
    (``compile`` may name a torch.compile backend). ``sync_every``: decode steps between host
    syncs (a finished slot idles at most that many steps). ``refill_at``: refill once this many
    slots are free. ``prefill_batch``: prompts per prefill call. ``padded_prefill``: prefill
    in fixed shapes (``prefill_batch`` rows × a multiple of 32 tokens; unused rows write to a
    spare cache row), each captured once as a CUDA graph when ``cuda_graph`` — default: as
    ``cuda_graph``. ``attention``: the decode step's attention, ``sdpa`` or ``matmul``.
    ``gate``: the compile gate (default: the process's).
    """

    def __init__(self, model, *, slots: int, max_len: int, max_new_tokens: int,
                 eos_ids: Sequence[int], temperature: float = 0.0,
                 compile: bool | str | None = None, cuda_graph: bool | None = None,
                 sync_every: int | None = None, refill_at: int | None = None,
                 prefill_batch: int | None = None, padded_prefill: bool | None = None,
                 attention: str = "sdpa", gate=None):
        why = unsupported_reason(model)
        if why:
            raise DFlashError(f"fast generation engine: unsupported target: {why}")
        if max_new_tokens < 1 or slots < 1:
            raise DFlashError("fast generation engine: slots and max_new_tokens must be >= 1")
        if not eos_ids:
            raise DFlashError("fast generation engine: no eos token id: generation could not stop")
        if attention not in DECODE_ATTENTION:
            raise DFlashError(f"fast generation engine: attention {attention!r} is not one of "
                              f"{', '.join(DECODE_ATTENTION)}")
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        self.B = int(slots)
        self.max_new = int(max_new_tokens)
        self.S = round_up(max(int(max_len), self.max_new + 1), 16)
        self.temperature = float(temperature)
        self.attention = attention
        self.compile = (cuda if compile is None else compile)
        self.cuda_graph = bool(cuda if cuda_graph is None else cuda_graph) and cuda
        self.sync_every = int(sync_every or (8 if self.cuda_graph else 1))
        self.padded_prefill = bool(self.cuda_graph if padded_prefill is None else padded_prefill)
        default_batch = max(16, min(self.B // 16, 256)) if self.cuda_graph else 256
        self.prefill_batch = int(prefill_batch or max(1, min(self.B, default_batch)))
        self.refill_at = int(refill_at or max(1, min(self.prefill_batch, self.B // 16)))
        self.gate = gate or get_gate()
        self.rope = rope_of(self.layers[0])
        self.stats: dict[str, Any] = {"compile_seconds": 0.0, "capture_seconds": 0.0,
                                      "prefill_calls": 0, "prefill_seconds": 0.0,
                                      "decode_steps": 0, "new_tokens": 0, "answers": 0}

        dev, B, S = self.device, self.B, self.S
        R = B + 1  # row B is a spare: padded prefill rows write there, decode never reads it
        with torch.inference_mode():
            # decode uses the first B rows of the cache
            cache = TargetCache(model, rows=R, S=S)
            self.k_rows, self.v_rows = cache.k, cache.v
            self.k_cache = [t[:B] for t in self.k_rows]
            self.v_cache = [t[:B] for t in self.v_rows]
            self.cos, self.sin, self.pos_ar = cache.cos, cache.sin, cache.pos_ar
            self.slot_ar = torch.arange(B, device=dev)
            self.eos = torch.tensor(sorted({int(e) for e in eos_ids}), device=dev)
            self.vocab_hash = mix32(torch.arange(self.model.lm_head.out_features, device=dev,
                                                  dtype=torch.int64) * 0x9E3779B1 & M32)
            # per-slot state (static addresses: the captured graphs read and write these)
            self.rows = {name: torch.zeros(R, dtype=dt, device=dev) for name, dt in (
                ("tok", torch.long), ("pos", torch.long), ("gen", torch.long),
                ("active", torch.bool), ("keys", torch.long))}
            self.out_rows = torch.zeros(R, self.max_new, dtype=torch.long, device=dev)
            self.tok, self.pos, self.gen = (self.rows[k][:B] for k in ("tok", "pos", "gen"))
            self.active, self.keys = self.rows["active"][:B], self.rows["keys"][:B]
            self.out = self.out_rows[:B]
        self._pre, self._post, self._head = _qkv, DECODE_ATTENTION[attention], pick_token
        self._captured = CapturedStep(self._decode_step, device=dev,
                                      enabled=bool(self.compile or self.cuda_graph),
                                      cuda_graph=self.cuda_graph, stats=self.stats,
                                      tag="generate", gate=self.gate)
        self.prefill = Prefill(self._prefill_body, rows=self.prefill_batch, spare_row=B,
                               cache_len=S, max_new=self.max_new, padded=self.padded_prefill,
                               device=dev, gate=self.gate, stats=self.stats)
        self.setup_seconds = 0.0

    # -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Compile and capture now (else the first :meth:`stream` does), timed apart from the
        generation that follows (:meth:`settings`' ``setup_seconds``)."""
        t0 = time.time()
        self._prepare()
        self.setup_seconds = time.time() - t0

    def settings(self) -> dict:
        """What the data manifest records about this engine (``engine_settings``)."""
        return {"slots": self.B, "cache_len": self.S, "compiled": bool(self.compile),
                "cuda_graph": self._captured.graph is not None, "sync_every": self.sync_every,
                "setup_seconds": round(self.setup_seconds, 2),
                "decode_steps": self.stats["decode_steps"],
                "prefill_calls": self.stats["prefill_calls"],
                **({"graph_error": self.stats["graph_error"]} if "graph_error" in self.stats
                   else {})}

    def _decode_step(self) -> None:
        """One token for every slot; inactive slots compute but change nothing."""
        pos = self.pos
        x = self.base.embed_tokens(self.tok[:, None])                        # [B, 1, H]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]            # [B, 1, D]
        mask = (self.pos_ar[None, :] <= pos[:, None])[:, None, None, :]      # [B, 1, 1, S]
        for layer, kc, vc in zip(self.layers, self.k_cache, self.v_cache):
            q, k, v = self._pre(layer, x, cos, sin, self.rope)
            kc[self.slot_ar, :, pos] = k[:, :, 0]
            vc[self.slot_ar, :, pos] = v[:, :, 0]
            x = self._post(layer, x, q, kc, vc, mask)
        nxt = self._head(self.model, x[:, 0], self.temperature, self.keys, self.gen,
                         self.vocab_hash)
        act = self.active
        nxt = torch.where(act, nxt, self.tok)
        at = self.gen.clamp(max=self.max_new - 1)
        self.out[self.slot_ar, at] = torch.where(act, nxt, self.out[self.slot_ar, at])
        finished = act & (self._is_eos(nxt) | (self.gen + 1 >= self.max_new))
        self.gen += act.long()
        self.pos += act.long()
        self.tok.copy_(nxt)
        self.active &= ~finished

    def _is_eos(self, tok):
        # a broadcast compare, not torch.isin (whose sort-based path is no graph-capture risk
        # worth taking for a handful of ids)
        return (tok[:, None] == self.eos[None, :]).any(-1)

    def _prefill_body(self, ids, lens, idx, kt) -> None:
        """Prompts ``ids`` [n, P] (right-padded, causal) into cache rows ``idx``; each row's
        first token picked from its last prompt position. Device tensors only, no host sync
        (it is captured as a CUDA graph per padded shape)."""
        n, P = ids.shape
        rows = self.rows
        x = self.base.embed_tokens(ids)
        cos, sin = self.cos[:P][None], self.sin[:P][None]
        for layer, kc, vc in zip(self.layers, self.k_rows, self.v_rows):
            q, k, v = _qkv(layer, x, cos, sin, self.rope)
            kc[idx, :, :P] = k
            vc[idx, :, :P] = v
            G = q.shape[1] // k.shape[1]
            kvh, D = k.shape[1], k.shape[3]
            # GQA as HF's repeat_kv (expand + reshape; no host sync)
            kx = k[:, :, None].expand(n, kvh, G, P, D).reshape(n, kvh * G, P, D)
            vx = v[:, :, None].expand(n, kvh, G, P, D).reshape(n, kvh * G, P, D)
            o = F.scaled_dot_product_attention(q, kx, vx, is_causal=True,
                                               scale=layer.self_attn.scaling)
            x = _out_mlp(layer, x, o.transpose(1, 2).reshape(n, P, -1))
        last = x[torch.arange(n, device=ids.device), lens - 1]
        nxt = pick_token(self.model, last, self.temperature, kt,
                    torch.zeros(n, dtype=torch.long, device=ids.device), self.vocab_hash)
        rows["tok"][idx] = nxt
        rows["pos"][idx] = lens
        # index_fill_, not `rows["gen"][idx] = 1`: a Python scalar written through a tensor index
        # becomes a CPU tensor copied to the device, which CUDA-graph capture refuses (it kept
        # every padded prefill uncaptured on the H200 through round 3)
        rows["gen"].index_fill_(0, idx, 1)
        rows["keys"][idx] = kt
        self.out_rows[idx, 0] = nxt
        rows["active"][idx] = ~(self._is_eos(nxt) | (self.max_new <= 1))

    def _prepare(self) -> None:
        """Compile the per-layer pieces and capture the decode step and the padded prefills
        (once, exclusive gate); a failed capture leaves the prefills uncaptured."""
        also = self.prefill.capture if self.padded_prefill else None
        if not self._captured.prepare(self._warm_up, "generate: compile + capture the decode "
                                      "step", also_capture=also):
            self.prefill.graphs.clear()

    def _warm_up(self) -> None:
        """The pieces compiled, then two decode steps (compile, then one warm run: autotune,
        lazy inits) on a snapshot of the slot state, restored after."""
        if self.compile:
            backend = self.compile if isinstance(self.compile, str) else "inductor"
            self._pre = compile_region(_qkv, backend)
            self._post = compile_region(DECODE_ATTENTION[self.attention], backend)
            self._head = compile_region(pick_token, backend)
        saved = self._snapshot()
        for _ in range(2):
            self._decode_step()
        self._restore(saved)

    def _snapshot(self):
        return [t.clone() for t in self.rows.values()]

    def _restore(self, saved) -> None:
        for t, s in zip(self.rows.values(), saved):
            t.copy_(s)

    def _replay(self, n: int) -> None:
        self._captured.replay(n)
        self.stats["decode_steps"] += n

    # -------------------------------------------------------------------------------------
    def stream(self, items: Iterable[tuple[Hashable, Sequence[int], int | None]]
               ) -> Iterator[tuple[Hashable, list[int]]]:
        """Generate for ``(key, prompt_ids, seed)`` items (read lazily, as slots free up);
        yield ``(key, answer_ids)`` in completion order. An answer ends at its first eos
        (included) or after ``max_new_tokens``. ``seed`` is ignored when greedy.

        Order of work per round, so the host's work overlaps the device's: launch
        ``sync_every`` decode steps; prefill waiting prompts into the slots freed last round
        (queued behind those steps on the same stream, so the kernel launches of the eager
        prefill overlap the decode); hand out last round's answers; then one sync to find the
        slots that finished.
        """
        self._prepare()
        feed = iter(items)
        state = {"exhausted": False}
        occupied: dict[int, Hashable] = {}
        free = list(range(self.B - 1, -1, -1))  # pop() hands out low slots first
        limit = self.S - self.max_new

        def refill(force: bool) -> None:
            while free and not state["exhausted"] and (force or len(free) >= self.refill_at):
                group: list[tuple[int, Hashable, Sequence[int], int]] = []
                while free and len(group) < self.prefill_batch:
                    try:
                        key, ids, seed = next(feed)
                    except StopIteration:
                        state["exhausted"] = True
                        break
                    if not 0 < len(ids) <= limit:
                        raise DFlashError(
                            f"fast generation engine: prompt {key!r} has {len(ids)} tokens; "
                            f"1..{limit} fit (max_len {self.S} - max_new_tokens {self.max_new})")
                    group.append((free.pop(), key, ids, int(seed or 0)))
                if group:
                    keys = seed_keys(torch.tensor([g[3] & ((1 << 63) - 1) for g in group],
                                                  dtype=torch.long)).tolist()
                    self.prefill.run([g[0] for g in group], [g[2] for g in group], keys)
                    for slot, key, _, _ in group:
                        occupied[slot] = key
                force = False

        pending: list[tuple[Hashable, Any, int]] = []
        with torch.inference_mode():
            refill(force=True)
            while occupied or pending:
                if occupied:
                    self._replay(self.sync_every)
                refill(force=not occupied)
                for key, row, n in pending:
                    self.stats["new_tokens"] += n
                    self.stats["answers"] += 1
                    yield key, row[:n].tolist()
                pending = []
                if not occupied:
                    continue
                active = self.active.cpu().tolist()  # the one sync per round
                done = [s for s in occupied if not active[s]]
                if done:
                    idx = torch.tensor(done, device=self.device)
                    rows, lens = self.out[idx].cpu(), self.gen[idx].cpu().tolist()
                    for i, s in enumerate(done):
                        pending.append((occupied.pop(s), rows[i], lens[i]))
                        free.append(s)

    def generate(self, prompts: Sequence[Sequence[int]],
                 seeds: Sequence[int] | None = None) -> list[list[int]]:
        """Answers for ``prompts``, in prompt order."""
        out: list[list[int] | None] = [None] * len(prompts)
        items = ((i, p, None if seeds is None else seeds[i]) for i, p in enumerate(prompts))
        for i, toks in self.stream(items):
            out[i] = toks
        return out  # type: ignore[return-value]


def generate(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             eos_ids: Sequence[int], temperature: float = 0.0,
             seeds: Sequence[int] | None = None, slots: int = 256, **engine_kw) -> list[list[int]]:
    """One-shot convenience: an :class:`Engine` sized for these prompts, then its answers."""
    if not prompts:
        return []
    max_len = max(len(p) for p in prompts) + max_new_tokens
    eng = Engine(model, slots=min(slots, len(prompts)), max_len=max_len,
                 max_new_tokens=max_new_tokens, eos_ids=eos_ids, temperature=temperature,
                 **engine_kw)
    return eng.generate(prompts, seeds)
