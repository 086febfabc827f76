"""Acceptance length τ the way a serving system sees it (greedy, lossless, block = drafter's).

Simulated acceptance for every eval set (docs/design.md §7; SpecForge's ``simulated_acc_len``). With
greedy decoding every token speculative decoding emits is the target's own greedy token, so:

1. the target's greedy continuation of each prompt (:func:`greedy_continuations`), by one fast
   generation engine that every eval set reuses (:func:`continuation_engine`);
2. one target forward over prompt + continuation gives every feature the drafter would see
   (:func:`target_features`, batched and padded);
3. the drafter drafts a block at EVERY continuation position in a few large batched calls: each
   position is an anchor whose context is the features strictly before it, blocks do not see
   each other — exactly the training layout (:mod:`dflash.models.masks`), so one dense mask per call
   (:func:`draft_every_position`);
4. the host walks the chain (:func:`walk_chain`): the block at s_j accepts the longest prefix of
   its drafts that matches the continuation; the next block starts at s_j + accepted_j + 1.

Step 3 drafts at every position although only ~1/τ of them start a block: that is at most B×
the drafter work of the blocks actually used, but a handful of big batched calls instead of one
small call per round per prompt (measured in docs/benchmarks.md). The drafts at every position
also give the teacher-forced per-position accuracy (the training metric) on eval data.

Real speculative decoding (:mod:`dflash.decode.eager`, with the drafter KV cache) runs on a few
prompts of the first set: wall-clock tokens/s of target-only vs speculative decoding, the speed-up, and
a check that its tokens and block lengths equal the simulated ones and target greedy's.

The eval sets themselves (MT-Bench, HumanEval, held-out prompts) are :mod:`dflash.eval.evalsets`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..decode.engine import Engine, unsupported_reason
from ..decode.generate import generate_batch
from ..models.drafter import extract_features
from ..models.masks import Blocks, dense_mask
from ..runtime.busy import sync
from .budget import budget_hits, budgets
from .evalsets import EvalSet
from .serving import pair, tau_gap
from .spread import pooled_interval


@dataclass
class Chain:
    """The blocks of one prompt's speculative decode: per block its start (index of the anchor
    in the continuation), the drafts accepted (truncated at the continuation's end), the tokens
    it produced and the continuation tokens that were left after its anchor."""
    starts: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# 1-2: the target's greedy continuation and its features
# ---------------------------------------------------------------------------------------------
def greedy_continuations(model, prompts: Sequence[Sequence[int]], max_new: int,
                         eos_ids: Sequence[int], batch_size: int = 64,
                         max_context: int | None = None, engine=None) -> list[list[int]]:
    """The target's greedy continuation of every prompt (ends at eos, inclusive, or max_new),
    each budget capped by ``max_context`` (:func:`dflash.eval.budget.budgets`; none left: []).

    ``engine`` (a :class:`dflash.decode.engine.Engine` for ``max_new``) takes the prompts it fits
    in one continuous batch; the rest go through :func:`dflash.decode.generate.generate_batch`,
    prompts of similar length batched together (little left padding), per budget.
    """
    budget = budgets(prompts, max_new, max_context)
    out: list[list[int]] = [[] for _ in prompts]
    fast = [i for i, p in enumerate(prompts) if engine is not None and budget[i] == max_new
            and engine.max_new == max_new and len(p) <= engine.S - engine.max_new]
    for i, g in zip(fast, engine.generate([prompts[i] for i in fast]) if fast else []):
        out[i] = g
    rest = [i for i in range(len(prompts)) if i not in set(fast) and budget[i] > 0]
    for b in sorted({budget[i] for i in rest}):
        order = sorted((i for i in rest if budget[i] == b), key=lambda i: len(prompts[i]))
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            gen = generate_batch(model, [prompts[i] for i in idx], b, 0.0, eos_ids,
                                 pad_id=eos_ids[0])
            for i, g in zip(idx, gen):
                out[i] = g
    return out


@torch.no_grad()
def target_features(model, seqs: Sequence[Sequence[int]], layer_ids: list[int],
                    batch_size: int = 16, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Feature-layer hidden states [len, n*H] of every sequence: one forward per batch of at
    most ``batch_size`` right-padded sequences (padding after a causal sequence changes nothing
    before it) and, given ``max_tokens``, of at most that many padded tokens (long answers)."""
    dev = next(model.parameters()).device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    batches: list[list[int]] = []
    for i in order:  # sorted by length: each new sequence is its batch's longest
        n = len(batches[-1]) + 1 if batches else 0
        if 0 < n <= batch_size and (not max_tokens or n * len(seqs[i]) <= max_tokens):
            batches[-1].append(i)
        else:
            batches.append([i])
    for idx in batches:
        L = max(len(seqs[i]) for i in idx)
        ids = torch.zeros((len(idx), L), dtype=torch.long)
        attn = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, :len(seqs[i])] = torch.tensor(list(seqs[i]))
            attn[r, :len(seqs[i])] = 1
        res = model(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                    output_hidden_states=True, logits_to_keep=1, use_cache=False)
        feats = extract_features(res.hidden_states, layer_ids)
        for r, i in enumerate(idx):
            out[i] = feats[r, :len(seqs[i])]
    return out


# ---------------------------------------------------------------------------------------------
# 3: the drafter's block at every position, batched
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def draft_every_position(drafter, embed: torch.Tensor, lm_head: torch.Tensor,
                         seqs: Sequence[Sequence[int]], feats: Sequence[torch.Tensor],
                         starts: Sequence[int], query_tokens: int = 4096,
                         logit_rows: int = 2048) -> list[torch.Tensor]:
    """Greedy drafts [n_i - 1, B-1] for every prompt: row j = the block anchored at sequence
    position ``starts[i] + j`` (the j-th continuation token), context = positions before it.

    Rows of (prompt, chunk of anchors) are grouped into calls of about ``query_tokens`` block
    tokens; the mask is the training mask (:func:`dflash.models.masks.dense_mask`), so this is exactly
    the computation of :func:`dflash.decode.eager.draft_block` at each anchor, batched.
    ``embed``/``lm_head`` should already be in the drafter's dtype and on its device.
    """
    cfg = drafter.cfg
    B, dev = cfg.block_size, embed.device
    # anchors per row: at most 64, so that the block-to-block part of the dense mask (Q x Q,
    # all but the diagonal blocks masked) stays small next to the context part (Q x L)
    n_max = max((len(s) - st - 1 for s, st in zip(seqs, starts)), default=0)
    per_row = max(1, min(64, n_max, query_tokens // B))
    rows = []                                           # (prompt, first anchor j, count)
    for i, (seq, st) in enumerate(zip(seqs, starts)):
        n_anchor = len(seq) - st - 1
        for j in range(0, max(0, n_anchor), per_row):
            rows.append((i, j, min(per_row, n_anchor - j)))
    rows.sort(key=lambda r: len(seqs[r[0]]))
    out = [torch.empty((max(0, len(s) - st - 1), B - 1), dtype=torch.long)
           for s, st in zip(seqs, starts)]
    rows_per_call = max(1, query_tokens // (per_row * B))
    k = torch.arange(B)
    for c in range(0, len(rows), rows_per_call):
        group = rows[c:c + rows_per_call]
        R, A = len(group), per_row
        L = max(len(seqs[i]) for i, _, _ in group)
        doc = torch.full((R, L), -1, dtype=torch.long)
        ctx = torch.zeros((R, L, feats[group[0][0]].shape[-1]), dtype=feats[group[0][0]].dtype,
                          device=dev)
        anchor = torch.zeros((R, A), dtype=torch.long)
        valid = torch.zeros((R, A), dtype=torch.bool)
        ids = torch.full((R, A, B), cfg.mask_token_id, dtype=torch.long)
        for r, (i, j, cnt) in enumerate(group):
            seq = torch.tensor(list(seqs[i]))
            doc[r, :len(seq)] = 0
            ctx[r, :len(seq)] = feats[i].to(dev)
            a = starts[i] + j + torch.arange(cnt)
            anchor[r, :cnt] = a
            valid[r, :cnt] = True
            ids[r, :cnt, 0] = seq[a]
        bpos = (anchor[:, :, None] + k).reshape(R, A * B)
        blocks = Blocks(anchor_pos=anchor, valid=valid, block_input_ids=ids.reshape(R, A * B),
                        block_position_ids=bpos, labels=torch.zeros_like(bpos),
                        block_doc=torch.where(valid, 0, -1), block_size=B)
        mask = dense_mask(doc.to(dev), Blocks(**{f: (v.to(dev) if torch.is_tensor(v) else v)
                                                 for f, v in vars(blocks).items()}))
        emb = torch.nn.functional.embedding(ids.reshape(R, A * B).to(dev), embed)
        h = drafter(emb, ctx, bpos.to(dev), torch.arange(L, device=dev).expand(R, L),
                    mask=mask, attention="sdpa")
        h = h.reshape(R, A, B, -1)[:, :, 1:].reshape(R * A * (B - 1), -1)
        head = lm_head.to(h.dtype)
        best = torch.cat([(h[s:s + logit_rows] @ head.t()).argmax(-1)
                          for s in range(0, h.shape[0], logit_rows)]).reshape(R, A, B - 1).cpu()
        for r, (i, j, cnt) in enumerate(group):
            out[i][j:j + cnt] = best[r, :cnt]
    return out


# ---------------------------------------------------------------------------------------------
# 4: the chain of blocks, and what it adds up to
# ---------------------------------------------------------------------------------------------
def walk_chain(drafts: torch.Tensor, continuation: Sequence[int]) -> Chain:
    """The blocks real greedy speculative decoding would run, given the drafts at every anchor.

    ``drafts[j]`` are the B-1 drafts after continuation token j. A block at j accepts the
    longest prefix matching ``continuation[j+1:]``; it produces accepted + 1 tokens (the bonus),
    truncated to what is left, and the next block starts there. As in
    :func:`dflash.decode.eager.speculative_generate`, the first token (from the prefill) is not
    a block.
    """
    n = len(continuation)
    cont = torch.tensor(list(continuation), dtype=torch.long)
    ch = Chain()
    j = 0
    while j < n - 1:
        r = n - 1 - j
        w = min(drafts.shape[1], r)
        m = int((drafts[j, :w] == cont[j + 1:j + 1 + w]).long().cumprod(0).sum())
        produced = min(m + 1, r)
        ch.starts.append(j)
        ch.accepted.append(m)
        ch.produced.append(produced)
        ch.remaining.append(r)
        j += produced
    return ch


def summarize(chains: Sequence[Chain], block_size: int) -> dict:
    """τ (tokens per verification forward, over all blocks) with its 95 % interval over prompts
    (:mod:`dflash.eval.spread`; None below 2 prompts), the reference's per-prompt mean,
    the histogram of tokens per forward, and the acceptance rate by block position k: the share
    of blocks whose drafts 1..k were all accepted, among blocks with at least k tokens left."""
    produced = sum(sum(c.produced) for c in chains)
    forwards = sum(len(c.produced) for c in chains)
    per_prompt = [sum(c.produced) / len(c.produced) for c in chains if c.produced]
    rate = []
    for k in range(1, block_size):
        eligible = [a for c in chains for a, r in zip(c.accepted, c.remaining) if r >= k]
        rate.append(sum(a >= k for a in eligible) / len(eligible) if eligible else None)
    hist = [0] * (block_size + 1)
    for c in chains:
        for p in c.produced:
            hist[p] += 1
    return {"tau": produced / forwards if forwards else None,  # ci95: over prompts (spread.py)
            "tau_ci95": pooled_interval([sum(c.produced) for c in chains],
                                        [len(c.produced) for c in chains])["ci95"],
            "tau_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
            "prompts": len(chains), "forwards": forwards, "tokens": produced,
            "accept_rate_by_position": rate,
            "tokens_per_forward_histogram": hist}


def teacher_forced_accuracy(drafts: Sequence[torch.Tensor], conts: Sequence[Sequence[int]]
                            ) -> list[float | None]:
    """Top-1 accuracy of draft position k at EVERY anchor (the training metric, on eval data)."""
    B1 = drafts[0].shape[1] if drafts else 0
    hit, tot = [0] * B1, [0] * B1
    for d, c in zip(drafts, conts):
        cont = torch.tensor(list(c), dtype=torch.long)
        for k in range(B1):
            n = len(c) - 1 - k                       # anchors with a label at k+1
            if n > 0 and d.shape[0]:
                hit[k] += int((d[:n, k] == cont[k + 1:k + 1 + n]).sum())
                tot[k] += n
    return [h / t if t else None for h, t in zip(hit, tot)]


# ---------------------------------------------------------------------------------------------
# the evaluation
# ---------------------------------------------------------------------------------------------
def continuation_engine(model, prompt_lists: Sequence[Sequence[Sequence[int]]], max_new: int,
                        eos_ids: Sequence[int], slots: int,
                        max_len: int | None = None) -> Engine | None:
    """One fast generation engine for the greedy continuations of every prompt list (the
    bench stage's eval sets): static KV cache, compiled and captured on CUDA, built once and
    reused by each set. Without it each set's continuations ran HF's eager loop, one
    launch-bound forward per token (26-34 s a set on the H200, round 7's bench_seconds);
    continuous batching has no padding either. ``max_len``: the cache's length (default: the
    longest prompt + ``max_new``). None where the engine cannot run the model
    (:func:`greedy_continuations` then takes HF's loop)."""
    prompts = [p for ps in prompt_lists for p in ps]
    if not prompts or unsupported_reason(model) is not None:
        return None
    most = max(len(ps) for ps in prompt_lists)
    return Engine(model, slots=max(1, min(slots, most)), max_new_tokens=max_new,
                  max_len=max_len or max(len(p) for p in prompts) + max_new,
                  eos_ids=list(eos_ids))


def simulate(target_model, drafter, embed, lm_head, prompts: Sequence[Sequence[int]],
             max_new: int, eos_ids: Sequence[int], layer_ids: list[int], device: str,
             batch_size: int = 64, continuations: Sequence[Sequence[int]] | None = None,
             feature_tokens: int | None = None, engine: Engine | None = None) -> dict:
    """Simulated acceptance of one prompt list: continuations (generated here unless given,
    by ``engine`` where it fits: :func:`continuation_engine`), chains, timings.
    ``feature_tokens``: :func:`target_features`' ``max_tokens``."""
    timings = {}
    t = time.perf_counter()
    conts = (greedy_continuations(target_model, prompts, max_new, eos_ids, batch_size,
                                  engine=engine)
             if continuations is None else [list(c) for c in continuations])
    sync(device)
    timings["generate_s"] = time.perf_counter() - t
    t = time.perf_counter()
    seqs = [list(p) + list(c) for p, c in zip(prompts, conts)]
    feats = target_features(target_model, seqs, layer_ids, max(1, batch_size // 4),
                            feature_tokens)
    sync(device)
    timings["features_s"] = time.perf_counter() - t
    t = time.perf_counter()
    on_gpu = str(device).startswith("cuda")
    drafts = draft_every_position(drafter, embed, lm_head, seqs, feats,
                                  [len(p) for p in prompts],
                                  query_tokens=32768 if on_gpu else 2048,
                                  logit_rows=8192 if on_gpu else 1024)
    sync(device)
    timings["draft_s"] = time.perf_counter() - t
    chains = [walk_chain(d, c) for d, c in zip(drafts, conts)]
    return {"continuations": conts, "chains": chains, "drafts": drafts, "timings": timings}


def real_decode(target_model, drafter, cfg, embed, lm_head, prompts: Sequence[Sequence[int]],
                max_new: int, eos_ids: Sequence[int], device: str, batch: int = 1,
                compile_shapes: str | None = None) -> dict:
    """Target-only and speculative decoding through the one decoder
    (:func:`dflash.eval.serving.pair`: static caches, captured steps on CUDA, each engine
    compiled and captured before it is timed), ``batch`` prompts at a time; ``compile_shapes``:
    the decoder's (``bench.decode_shapes``: the sweep after it reuses these graphs)."""
    if not prompts:
        return {"results": [], "greedy": [], "divergences": []}
    r = pair(target_model, drafter, [list(p) for p in prompts], batch, max_new, eos_ids,
             embed, lm_head, compile_shapes=compile_shapes)
    r["greedy"] = [g.tokens for g in r["greedy"]]
    r["divergences"] = r["lossless_evidence"]["divergences"]
    return r


def real_chain(res, n_tokens: int) -> Chain:
    """A real decode's blocks in :class:`Chain` terms (accepted truncated at the end)."""
    ch, j = Chain(), 0
    for a, p in zip(res.accepted, res.block_lengths):
        r = n_tokens - 1 - j
        ch.starts.append(j)
        ch.accepted.append(min(a, r))
        ch.produced.append(p)
        ch.remaining.append(r)
        j += p
    return ch


def evaluate_sets(target_model, drafter, embed, lm_head, sets: Sequence[EvalSet], max_new: int,
                  eos: Sequence[int], real_prompts: int, device: str, batch_size: int = 64,
                  log=print, compile_shapes: str | None = None) -> dict:
    """Simulated τ on every set; real decoding of the first ``real_prompts`` prompts of the
    FIRST set (the primary one: its speed-up and the simulated == real check; on CPU real
    decoding costs far more than simulation, so it is not repeated on every set).

    ``embed``/``lm_head`` are the target's (any dtype: they are cast to the drafter's once)."""
    cfg = drafter.cfg
    B = cfg.block_size
    embed = embed.to(device=device, dtype=drafter.dtype)
    lm_head = lm_head.to(device=device, dtype=drafter.dtype)
    engine = continuation_engine(target_model, [es.prompts for es in sets], max_new, eos,
                                 batch_size)
    out: dict = {}
    for n_set, es in enumerate(sets):
        if not es.prompts:
            out[es.name] = {"skipped": es.note or "no prompts"}
            log(f"[bench] τ {es.name}: skipped ({out[es.name]['skipped']})")
            continue
        t0 = time.perf_counter()
        sim = simulate(target_model, drafter, embed, lm_head, es.prompts, max_new, eos,
                       cfg.target_layer_ids, device, batch_size, engine=engine)
        rep = summarize(sim["chains"], B)
        rep["simulated_s"] = round(time.perf_counter() - t0, 3)
        rep["timings_s"] = {k: round(v, 3) for k, v in sim["timings"].items()}
        rep["teacher_forced_accuracy_by_position"] = teacher_forced_accuracy(
            sim["drafts"], sim["continuations"])
        rep["hit_cap"] = budget_hits(es.prompts, sim["continuations"], max_new, eos)
        rep["note"] = es.note
        if es.categories:  # a prompt without one (train: not self-written) counts in no row
            cats: dict[str, list[Chain]] = {}
            for c, ch in zip(es.categories, sim["chains"]):
                if c is not None:
                    cats.setdefault(c, []).append(ch)
            rep["tau_by_category"] = {c: summarize(v, B)["tau"] for c, v in sorted(cats.items())}
            rep["prompts_by_category"] = {c: len(v) for c, v in sorted(cats.items())}
        n_real = min(real_prompts, len(es.prompts)) if n_set == 0 else 0
        if n_real:
            t1 = time.perf_counter()
            real = real_decode(target_model, drafter, cfg, embed, lm_head,
                               es.prompts[:n_real], max_new, eos, device,
                               compile_shapes=compile_shapes)
            rchains = [real_chain(r, len(r.tokens)) for r in real["results"]]
            same_tokens = [r.tokens == c for r, c in zip(real["results"],
                                                         sim["continuations"])]
            rep["real"] = {
                **summarize(rchains, B), "seconds": round(time.perf_counter() - t1, 3),
                "target_only_tokens_per_s": real["target_only_tokens_per_s"],
                "speculative_tokens_per_s": real["speculative_tokens_per_s"],
                "speedup": real["speedup"],
                # lossless: every emitted token was the verify forward's argmax (checked on
                # the device) and every difference from one-token greedy decoding is a near-tie
                "lossless": real["lossless_evidence"]["lossless"],
                "lossless_prompts": sum(r.tokens == g for r, g in zip(real["results"],
                                                                      real["greedy"])),
                "lossless_evidence": real["lossless_evidence"],
                # simulated == real: same tokens (batched vs one-at-a-time greedy) and the same
                # blocks wherever the tokens agree
                "tokens_equal_simulated": sum(same_tokens),
                # first difference per non-identical prompt, with the target's logit margin there
                "divergences": real["divergences"],
                "blocks_equal_simulated": sum(
                    s and rc.produced == sc.produced
                    for s, rc, sc in zip(same_tokens, rchains, sim["chains"])),
            }
            rep["real"]["tau_simulated_same_prompts"] = summarize(sim["chains"][:n_real], B)["tau"]
            rep["real"]["tau_gap"] = tau_gap(real["results"], [
                summarize([ch], B)["tau"] for ch in sim["chains"][:n_real]])
            if rep["real"]["tau_gap"]["warning"]:
                log(f"[bench] WARNING {es.name}: {rep['real']['tau_gap']['warning']}")
        out[es.name] = rep
        log(f"[bench] τ {es.name}: {_f(rep['tau'])} over {rep['prompts']} prompts "
            f"(simulated in {rep['simulated_s']:.1f}s"
            + (f"; real on {n_real}: τ {_f(rep['real']['tau'])}, speed-up "
               f"{_f(rep['real']['speedup'])}, lossless {rep['real']['lossless']}"
               if n_real else "") + ")")
    return out


def _f(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


__all__ = ["Chain", "continuation_engine", "greedy_continuations", "target_features",
           "draft_every_position", "walk_chain",
           "summarize", "teacher_forced_accuracy", "simulate", "real_decode", "real_chain",
           "evaluate_sets"]
