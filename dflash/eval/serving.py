"""Speed-up as serving sees it: target-only vs speculative tokens/s through the ONE decoder
(:class:`dflash.decode.speculative.Decoder`) at several batch sizes, HF ``generate`` with its static
cache timed in the same run as the outside reference, τ real vs simulated per prompt, and the
lossless evidence.

Timing: each engine compiles and captures its steps first (untimed); a timed run is prefill +
decode of all prompts, ``batch`` at a time (a finished sequence idles until its wave ends),
between two device syncs. tokens/s = emitted tokens / seconds. HF's static path gets one untimed
warm-up wave (its compile), its prompts left-padded to one length so no wave recompiles.

What is served (:func:`pair`): after every engine is timed (target-only, the full block and
each verify width of ``widths``: anchor + 3 or 7 drafts make the verify GEMMs 4× / 2× smaller
at large batch, where the full block loses to target-only), the adaptive policy
(:mod:`dflash.decode.adaptive`) picks one from their warm waves' step times and tokens per
step, and ``served`` and ``choice_speedup`` (its tokens/s over target-only's) are the chosen
engine's timed decode, not assumed. The row's speculative figures stay the full block's;
``widths`` holds each width's.

Cost per batch size of the sweep (where the bench stage's time goes, ``wall_s`` per engine):
2 + (widths other than the block) decoders built, compiled and captured one at a time and
freed after (static shapes, ``compile_shapes="static"``: one compile per batch size and
engine, 5–22 s each on the H200 for SmolLM2-135M in round 17; ``"dynamic"``: the batch sizes
after the first two reuse symbolic graphs and only capture), each with one warm and one timed
decode of ``max(batch, min_prompts)`` prompts, and HF's static-cache generate only at the
batch sizes in ``hf_batches`` (default batch 1: each other batch size was one more transformers
compile and one more slow timed run, for a reference the goal reads at batch 1 only). Those
compiles are made ahead, in another process, by :func:`compile_ahead` (the decoders stage,
beside the data stage): the same :func:`decoder_plan`, so the sweep loads their kernels.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from transformers import GenerationConfig

from ..errors import DFlashError
from ..runtime.busy import sync
from ..runtime.gate import get_gate
from ..decode.adaptive import choose
from ..decode.decoded import lossless_evidence
from ..decode.speculative import Decoder, verify_width
from .spread import pooled_interval

SWEEP_BATCHES = (1, 4, 16, 64)
DECODE_WIDTHS = (4, 8, 16)  # bench.decode_widths' default: verify widths beside the full block
HF_BATCHES = (1,)  # HF static-cache generate, the outside reference, timed at these batch sizes
SERVING_GAP = 0.05  # warn when real and simulated τ of a prompt differ by more than this share


def timed_decode(dec: Decoder, prompts: Sequence[Sequence[int]], inspect=None, warm: int = 0):
    """(results, seconds) of decoding ``prompts`` after the (untimed) compile + capture and
    ``warm`` decodes of the same prompts; ``inspect(dec) -> dict``, run before the timed decode,
    adds to ``dec.stats`` (e.g. a kernel count of one step). With ``warm``, ``dec.stats["warm"]``
    is the last warm decode's seconds, steps and tokens: what the adaptive choice decides from,
    so the timed decode it is judged by is not the one it chose on."""
    dec.prepare()
    for _ in range(warm):
        steps = dec.stats.get("steps", 0)
        sync(dec.device)
        t = time.perf_counter()
        res = dec.decode(prompts)
        sync(dec.device)
        dec.stats["warm"] = {"seconds": time.perf_counter() - t,
                             "steps": dec.stats.get("steps", 0) - steps,
                             "tokens": sum(len(r.tokens) for r in res)}
    if inspect is not None:
        dec.stats.update(inspect(dec))
    sync(dec.device)
    t = time.perf_counter()
    res = dec.decode(prompts)
    sync(dec.device)
    return res, time.perf_counter() - t


def verify_widths(widths: Sequence[int], block: int) -> list[int]:
    """``bench.decode_widths`` as the sweep measures them: each clipped to the drafter's block
    (a verify wider than the drafts has nothing to check), deduplicated, in order."""
    bad = [w for w in widths if int(w) < 2]
    if bad:
        raise DFlashError(f"bench.decode_widths: {bad} (each verify width is anchor + drafts: >= 2)")
    return sorted({min(int(w), int(block)) for w in widths})


def decoder_plan(drafter, prompts: Sequence[Sequence[int]], batch: int, max_new: int,
                 eos: Sequence[int], embed=None, lm_head=None, widths: Sequence[int] = (),
                 **kw) -> list[tuple[int, dict]]:
    """The decoders :func:`pair` builds at one batch size, in its order, as (verify width,
    :class:`Decoder` keyword arguments): target-only (width 0), the full block (or ``kw``'s
    ``verify_tokens``), then every other verify width of ``widths`` (:func:`verify_widths`).
    The one list the timed sweep and the compile ahead (:func:`compile_ahead`) both build from,
    so their decoders have the same shapes by construction."""
    max_len = max(len(p) for p in prompts) + max_new
    common = dict(batch=batch, max_len=max_len, max_new_tokens=max_new, eos_ids=eos, **kw)
    base = {k: v for k, v in common.items() if k != "verify_tokens"}
    block = drafter.cfg.block_size
    first = verify_width(block, kw.get("verify_tokens"))
    spec = dict(drafter=drafter, embed=embed, lm_head=lm_head, **common)
    return [(0, {"drafter": None, **base}), (first, spec)] + [
        (w, {**spec, "verify_tokens": w}) for w in verify_widths(widths, block) if w != first]


def decoder_name(width: int) -> str:
    """A decoder of :func:`decoder_plan` as the sweep's records name it (``wall_s``)."""
    return "target_only" if width == 0 else f"verify_{width}"


def pair(target, drafter, prompts: Sequence[Sequence[int]], batch: int, max_new: int,
         eos: Sequence[int], embed=None, lm_head=None, inspect=None,
         widths: Sequence[int] = (), **kw) -> dict:
    """Target-only and speculative decoding of ``prompts`` at one batch size, each timed on
    its second decode (H200, round 7: a first decode ran 4-28 % slower than the next one of
    the same engine, so a served re-run timed against a first-run target-only read 1.15x for
    target-only itself); the per-prompt results and the lossless evidence (``inspect``:
    :func:`timed_decode`'s); the adaptive choice and what it serves: the chosen engine's timed
    decode (``served``, ``served_results``), over target-only's. ``widths``: verify widths
    timed beside the full block (:func:`verify_widths`), each its own decoder, one at a time
    (:func:`decoder_plan`): the choice picks among all of them, ``widths`` records each one's
    figures."""
    cost, runs = {}, {}  # runs: verify width (0: target-only) -> (results, timed s, stats)
    plan = decoder_plan(drafter, prompts, batch, max_new, eos, embed, lm_head, widths, **kw)
    for w, kwargs in plan:
        t = time.perf_counter()
        dec = Decoder(target, **kwargs)
        runs[w] = (*timed_decode(dec, prompts, inspect, warm=1), dict(dec.stats))
        del dec  # one decoder's caches and graphs at a time
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        cost[decoder_name(w)] = time.perf_counter() - t
    rb, tb, stats_base = runs.pop(0)
    width = plan[1][0]  # the full block (or kw's verify_tokens): the row's figures
    rs, ts, st = runs[width]
    nb, ns = sum(len(r.tokens) for r in rb), sum(len(r.tokens) for r in rs)
    adaptive = adaptive_choice(batch, stats_base, st, width, rs, max_new,
                               {w: run[2] for w, run in runs.items()})
    chosen = width if adaptive is None else adaptive["choice"]
    served, served_s, _ = (rb, tb, None) if chosen == 0 else runs[chosen]
    name = "target-only" if chosen == 0 else "speculative"
    n_served = sum(len(r.tokens) for r in served)
    served_tok_s = n_served / served_s if served_s else None
    base_tok_s = nb / tb if tb else None
    return {"batch": batch, "prompts": len(prompts), "results": rs, "greedy": rb,
            "target_only_s": tb, "speculative_s": ts, "timed": "second decode of each engine",
            "target_only_tokens_per_s": base_tok_s,
            "speculative_tokens_per_s": ns / ts if ts else None,
            "speedup": (ns / ts) / base_tok_s if ts and base_tok_s else None,
            "tau": _tau_of(rs),
            "tau_ci95": pooled_interval([sum(r.block_lengths) for r in rs],
                                        [r.target_forwards for r in rs])["ci95"],
            "lossless_evidence": lossless_evidence(rs, rb, st.get("checked", 0),
                                                   st.get("mismatches", 0)),
            "engine": {"target_only": _engine(stats_base), "speculative": _engine(st)},
            "widths": [_width_row(w, *runs[w], rb, base_tok_s, batch) for w in sorted(runs)],
            "wall_s": {k: round(v, 3) for k, v in cost.items()},
            **_chosen(adaptive, served_tok_s, base_tok_s), "choice_width": chosen,
            "served": {"engine": name, "seconds": served_s, "tokens": n_served,
                       "tokens_per_s": served_tok_s,
                       "identical_to_greedy": sum(a.tokens == g.tokens
                                                  for a, g in zip(served, rb))},
            "served_results": served, "adaptive": adaptive}


def _tau_of(results) -> float | None:
    fwd = sum(r.target_forwards for r in results)
    return sum(sum(r.block_lengths) for r in results) / fwd if fwd else None


def _warm_wave(stats: dict, batch: int) -> tuple[float | None, float | None]:
    """A warm wave's all-in ms per step and tokens per step and sequence (None: no steps)."""
    w = stats.get("warm", {})
    return (w["seconds"] * 1e3 / w["steps"], w["tokens"] / (w["steps"] * batch)) \
        if w.get("steps") else (None, None)


def _width_row(width: int, results, seconds: float, stats: dict, greedy, base_tok_s,
               batch: int) -> dict:
    """One verify width's figures: its timed decode's tokens/s and speed-up over target-only,
    τ, its warm wave's ms and tokens per step (what the choice read), lossless."""
    n = sum(len(r.tokens) for r in results)
    ms, tps = _warm_wave(stats, batch)
    ev = lossless_evidence(results, greedy, stats.get("checked", 0), stats.get("mismatches", 0))
    return {"width": width, "seconds": seconds, "tokens_per_s": n / seconds if seconds else None,
            "speedup": n / seconds / base_tok_s if seconds and base_tok_s else None,
            "tau": _tau_of(results), "step_ms": ms, "tokens_per_step": tps,
            "lossless": ev["lossless"], "identical_to_greedy": ev["identical_to_greedy"],
            "prefill_ms": stats.get("prefill_ms"), "prefill_graphs": stats.get("prefill_graphs")}


def adaptive_choice(batch: int, stats_base: dict, stats_spec: dict, width: int, results,
                    max_new: int, by_width: dict[int, dict] | None = None) -> dict | None:
    """:func:`dflash.decode.adaptive.choose` on each engine's warm wave (``stats["warm"]``, as
    :func:`pair` decodes it): its all-in ms per step (prefill and harvest included) and the
    tokens per step and sequence it realized, for target-only and every verify width
    (``by_width``: width -> stats; default the full block's ``stats_spec`` alone); the served
    accept shares by position of the full block (share of verify steps whose drafts 1..k were
    all accepted; a narrower verify only truncates them) are recorded beside. None where a wave
    has no steps."""
    ms_base, tps_base = _warm_wave(stats_base, batch)
    fwd = sum(r.target_forwards for r in results)
    if ms_base is None or not fwd:
        return None
    accept = [sum(r.accept_counts[k] for r in results) / fwd for k in range(width - 1)]
    step_ms, tps = {0: ms_base}, {0: tps_base}
    for w, s in (by_width or {width: stats_spec}).items():
        step_ms[w], tps[w] = _warm_wave(s, batch)
    rec = choose(batch, step_ms, accept, new_tokens=max_new,
                 tokens_per_step={w: t for w, t in tps.items() if t})
    return {**rec, "accept_rate_by_position": accept}


def _chosen(adaptive: dict | None, served_tok_s: float | None,
            base_tok_s: float | None) -> dict:
    """The choice and the speed-up of what it serves: the chosen engine's timed decode over
    target-only's (a target-only choice is target-only's own decode: 1.0)."""
    sp = served_tok_s / base_tok_s if served_tok_s and base_tok_s else None
    if adaptive is None:
        return {"choice": "speculative (no step times to decide)", "choice_speedup": sp}
    if adaptive["choice"] == 0:
        return {"choice": "target-only", "choice_speedup": sp}
    return {"choice": f"speculative (verify {adaptive['choice']})", "choice_speedup": sp}


def _engine(stats: dict) -> dict:
    keep = ("compile_scope", "compile_mode", "compile_shapes", "compile_seconds",
            "capture_seconds", "graphs_compiled", "steps", "syncs", "graph", "graph_error",
            "context_compile_error", "scope_compile_error",
            "fused_weight_bytes", "waves", "prefill_ms", "steps_ms", "harvest_ms", "warm",
            "prefill_graphs", "prefill_capture_seconds", "prefill_graph_error",
            # what an inspect hook measured (bench/gpu/step_profile.py)
            "replay_ms", "kernels", "kernel_device_ms", "top_kernels", "kernels_cpu_proxy",
            "profile_error")
    return {k: stats[k] for k in keep if k in stats}


def hf_static_wave(model, prompts: Sequence[Sequence[int]], batch: int, max_new: int,
                   eos: Sequence[int], pad_id: int):
    """HF ``generate(cache_implementation="static")`` (transformers compiles its step on CUDA),
    greedy, as a function of one wave of at most ``batch`` of ``prompts`` (each left-padded to
    the longest of them all, so no wave recompiles) -> its tokens, each answer counted up to its
    first eos (inclusive)."""
    dev = next(model.parameters()).device
    P = max(len(p) for p in prompts)
    gc = GenerationConfig(max_new_tokens=max_new, min_new_tokens=0, do_sample=False,
                          cache_implementation="static", eos_token_id=list(eos),
                          pad_token_id=pad_id)
    stops = set(int(e) for e in eos)

    def wave(ps) -> int:
        ids = torch.full((batch, P), pad_id, dtype=torch.long)
        att = torch.zeros((batch, P), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, P - len(p):] = torch.tensor(list(p))
            att[i, P - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev),
                                 generation_config=gc)
        n = 0
        for row in out[:len(ps), P:].tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
            n += cut
        return n

    return wave


def hf_static_generate(model, prompts: Sequence[Sequence[int]], batch: int, max_new: int,
                       eos: Sequence[int], pad_id: int, gate=None) -> dict:
    """HF static-cache ``generate`` (:func:`hf_static_wave`), ``batch`` prompts at a time, timed
    after one untimed warm-up wave (its compile)."""
    gate = gate or get_gate()
    dev = next(model.parameters()).device
    wave = hf_static_wave(model, prompts, batch, max_new, eos, pad_id)
    with gate.exclusive("decoder: HF static-cache generate warm-up (its compile)"):
        wave(prompts[:batch])
    sync(dev)
    t = time.perf_counter()
    with gate.shared():
        n = sum(wave(prompts[s:s + batch]) for s in range(0, len(prompts), batch))
    sync(dev)
    dt = time.perf_counter() - t
    return {"batch": batch, "prompts": len(prompts), "tokens": n, "seconds": dt,
            "tokens_per_s": n / dt if dt else None}


def tau_gap(real: Sequence, simulated: Sequence[float | None]) -> dict:
    """Per prompt τ real vs simulated, and a warning where they differ by more than
    :data:`SERVING_GAP` (the serving gap: acceptance that holds offline but not when served)."""
    rows, warn = [], []
    for i, (r, s) in enumerate(zip(real, simulated)):
        gap = abs(r.tau - s) / s if s and r.target_forwards else None
        rows.append({"prompt": i, "tau_real": r.tau if r.target_forwards else None,
                     "tau_simulated": s, "relative_gap": gap})
        if gap is not None and gap > SERVING_GAP:
            warn.append(i)
    return {"per_prompt": rows, "threshold": SERVING_GAP, "prompts_over_threshold": warn,
            "warning": (f"τ real and simulated differ by more than {SERVING_GAP:.0%} on "
                        f"{len(warn)} of {len(rows)} prompts") if warn else None}


def sweep(target, drafter, prompts: Sequence[Sequence[int]], max_new: int, eos: Sequence[int],
          batches: Sequence[int] = SWEEP_BATCHES, min_prompts: int = 8,
          hf_batches: Sequence[int] = HF_BATCHES, pad_id: int = 0, embed=None, lm_head=None,
          log=print, widths: Sequence[int] = DECODE_WIDTHS, **kw) -> dict:
    """The batch sweep: at each batch size ``max(batch, min_prompts)`` prompts (at most all),
    target-only and speculative tokens/s (the full block and every verify width in
    ``widths``), the adaptive choice among them and the timed run of what it chose, τ,
    lossless evidence; HF's static path at the batch sizes in ``hf_batches``."""
    rows, first = [], None
    for b in batches:
        ps = list(prompts[:max(b, min_prompts)])
        r = pair(target, drafter, ps, b, max_new, eos, embed, lm_head, widths=widths, **kw)
        hf = b in hf_batches
        if hf:
            r["hf_static"] = hf_static_generate(target, ps, b, max_new, eos, pad_id)
        if first is None:
            first = r
        row = {k: v for k, v in r.items() if k not in ("results", "greedy", "served_results")}
        ev = row["lossless_evidence"]
        ev["divergences"] = ev["divergences"][:16]
        rows.append(row)
        log(f"[decode] batch {b}: target-only {_f(r['target_only_tokens_per_s'])} tok/s, "
            f"speculative {_f(r['speculative_tokens_per_s'])} tok/s (τ {_f(r['tau'])}, "
            f"speed-up {_f(r['speedup'])}), choice {r['choice']} served "
            f"{_f(r['served']['tokens_per_s'])} tok/s ({_f(r['choice_speedup'])}x measured)"
            + (f", HF static {_f(r['hf_static']['tokens_per_s'])} tok/s" if hf else "")
            + f", lossless {ev['lossless']}; by verify width "
            + ", ".join(f"{w['width']}: {_f(w['tokens_per_s'])} tok/s ({_f(w['speedup'])}x)"
                        for w in r["widths"]))
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"batches": rows, "first": first, "max_new_tokens": max_new}


def compile_ahead(target, drafter, prompts: Sequence[Sequence[int]], max_new: int,
                  eos: Sequence[int], batches: Sequence[int] = SWEEP_BATCHES,
                  min_prompts: int = 8, hf_batches: Sequence[int] = HF_BATCHES, pad_id: int = 0,
                  embed=None, lm_head=None, log=print, widths: Sequence[int] = DECODE_WIDTHS,
                  **kw) -> list[dict]:
    """Every decoder :func:`sweep` builds from the same arguments (:func:`decoder_plan`, its
    prompts per batch size), compiled, captured and decoding its prompts once, one at a time;
    HF static generate's warm-up wave where the sweep times it. What is compiled lands in the
    process's compile cache (``TORCHINDUCTOR_CACHE_DIR``): nothing in it depends on the weights,
    so a sweep in another process, of a trained drafter of the same shape, loads the kernels
    instead of compiling them (:mod:`dflash.stages.decoders`). One record per decoder: its
    seconds, the compile's share and the graphs compiled."""
    rows = []
    for b in batches:
        ps = list(prompts[:max(b, min_prompts)])
        for w, kwargs in decoder_plan(drafter, ps, b, max_new, eos, embed, lm_head, widths,
                                      **kw):
            t = time.perf_counter()
            dec = Decoder(target, **kwargs)
            dec.prepare()
            dec.decode(ps)  # the prefill's shapes, as the sweep's untimed first decode
            rows.append({"batch": b, "decoder": decoder_name(w),
                         "seconds": round(time.perf_counter() - t, 3),
                         "compile_seconds": round(dec.stats["compile_seconds"], 3),
                         "graphs_compiled": dec.stats.get("graphs_compiled")})
            del dec
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        if b in hf_batches:
            t = time.perf_counter()
            with get_gate().exclusive("decoder: HF static-cache generate (compiled ahead)"):
                hf_static_wave(target, ps, b, max_new, eos, pad_id)(ps[:b])
            rows.append({"batch": b, "decoder": "hf_static",
                         "seconds": round(time.perf_counter() - t, 3)})
        done = [r for r in rows if r["batch"] == b]
        log(f"[decoders] batch {b}: {len(done)} decoder(s) in "
            f"{sum(r['seconds'] for r in done):.1f}s ("
            + ", ".join(f"{r['decoder']} {r['seconds']:.1f}s" for r in done) + ")")
    return rows


def sweep_arguments(bench, tokenizer, prompts: Sequence[Sequence[int]], eos: Sequence[int],
                    embed, lm_head, log=print) -> dict:
    """The arguments of :func:`sweep` (and :func:`compile_ahead`) but the two models, from a
    spec's ``bench`` section and the primary eval set's ``prompts``: the bench stage times with
    them and the decoders stage compiles ahead with them, so both build the same decoders."""
    pad = tokenizer.pad_token_id
    return dict(prompts=prompts, max_new=bench.eval_max_new_tokens, eos=eos,
                batches=bench.decode_batches, min_prompts=max(1, bench.real_prompts),
                pad_id=eos[0] if pad is None else pad, widths=bench.decode_widths,
                compile_shapes=bench.decode_shapes, embed=embed, lm_head=lm_head, log=log)


def goal(row: dict) -> dict:
    """The batch-1 goal figures of one sweep row (#36: speculative ≥ 0.85 × τ × target-only)."""
    spec, base, tau = row["speculative_tokens_per_s"], row["target_only_tokens_per_s"], row["tau"]
    hf = (row.get("hf_static") or {}).get("tokens_per_s")
    return {"speculative_over_tau_x_target_only": spec / (tau * base) if spec and base and tau
            else None,
            "speculative_over_hf_static": spec / hf if spec and hf else None,
            "target_only_over_hf_static": base / hf if base and hf else None,
            "targets": {"speculative_over_tau_x_target_only": 0.85,
                        "speculative_over_hf_static": 1.5, "target_only_over_hf_static": 1.0}}


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


__all__ = ["SWEEP_BATCHES", "DECODE_WIDTHS", "HF_BATCHES", "verify_widths", "SERVING_GAP",
           "timed_decode", "decoder_plan", "decoder_name", "pair", "adaptive_choice",
           "hf_static_wave", "hf_static_generate", "tau_gap", "sweep", "compile_ahead",
           "sweep_arguments", "goal"]
