"""Decoding speed as serving sees it: target-only vs speculative tokens/s through the one decoder
(dflash.decode.speculative), HF static-cache ``generate`` in the same run, at batch 1, 4, 16, 64; τ real
vs simulated per prompt; the lossless counts and margins. Prints the table, writes JSON.

    # the integrator's measurement: the trained drafter, the real target, MT-Bench first turns
    # (bench/results/h200/COMMANDS.md has the time estimate; --budget-s keeps it in one call)
    PYTHONPATH=$PWD python -m bench.gpu.decode_speed --spec specs/smollm2-quality.yaml \\
        --drafter results/smollm2-quality/train/drafter --batches 1,4,16,64 \\
        --hf-batches 1,4,16,64 --budget-s 420 --out bench/results/h200/decode_speed.json
    # the compile scopes side by side (dflash.decode.compile_choices.COMPILE_SCOPES; "scope:mode" adds a
    # torch.compile mode), same prompts, same drafter: per scope ms per step (wall and one
    # captured replay), compile seconds, kernels per step (CUDA profiler), the goal ratios
    PYTHONPATH=$PWD python -m bench.gpu.decode_speed --spec specs/smollm2-quality.yaml \\
        --drafter results/smollm2-quality/train/drafter --batches 1,16 --hf-batches "" \\
        --compile-scopes fused,step --no-simulated --budget-s 420 --out /tmp/scopes.json
    # the adaptive choice per batch (dflash.decode.adaptive): target-only, the whole block and
    # two narrower verifies timed, the choice and the speed-up of the choice printed per batch
    PYTHONPATH=$PWD python -m bench.gpu.decode_speed --spec specs/smollm2-quality.yaml \\
        --drafter results/smollm2-quality/train/drafter --batches 1,4,16,64 --hf-batches "" \\
        --adaptive-widths 4,8 --no-simulated --budget-s 420 --out /tmp/adaptive.json
    # the decoders' shapes static vs dynamic (bench.decode_shapes), one run each, same machine,
    # each compiling cold (its own empty inductor cache, as the DAG's bench stage does):
    # compile seconds and graphs per engine and batch size, ms per step; random weights
    for s in static dynamic; do TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$s \
        PYTHONPATH=$PWD python -m bench.gpu.decode_speed --random \
        --batches 1,4,16,64 --hf-batches "" --adaptive-widths 4,8 --no-simulated \
        --no-kernel-profile --compile-shapes $s --budget-s 240 --out /tmp/shapes_$s.json; done
    # CPU smoke: random 2-layer target, 1-layer drafter, every scope (dynamo + AOTAutograd)
    PYTHONPATH=$PWD python -m bench.gpu.decode_speed --smoke --out /tmp/decode_speed.json
    # CPU: a 4-layer stack of the same shapes, 8 new tokens (eager)
    PYTHONPATH=$PWD python -m bench.gpu.decode_speed --random --target-layers 4 --batches 1,4 \\
        --hf-batches 1,4 --max-new 8 --min-prompts 4 --prompts 8 --out /tmp/decode_speed.json
    # development without weights: random SmolLM2-135M-shaped target and drafter, random prompts
    PYTHONPATH=$PWD python -m bench.gpu.decode_speed --random --out /tmp/decode_speed.json

With random weights acceptance is ~0 (τ ≈ 1): the figures then time the steps (ms per verify
step vs per one-token step), not a speed-up.

JSON: the top-level figures of each batch size are the first compile scope's (the layout
bench/speedup_table.py reads); ``compile_scopes`` holds every scope's. ``--budget-s`` skips,
and records why, any piece (a batch size, a scope at it, HF's static path) whose estimate (1.5
x its wall time at the previous batch size) would pass the budget.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu.step_profile import step_profile
from dflash.decode.generate import eos_ids_of
from dflash.eval.evalsets import load_eval_sets
from dflash.decode.adaptive import choose
from dflash.decode.compile_choices import (COMPILE_SCOPES, COMPILE_SHAPES, DEFAULT_COMPILE_SCOPE,
                                           DEFAULT_COMPILE_SHAPES)
from dflash.decode.speculative import Decoder
from dflash.eval.serving import goal, hf_static_generate, pair, tau_gap, timed_decode
from dflash.eval.tau import simulate, summarize
from dflash.models.drafter import DFlashConfig, DFlashDrafter, load_drafter
from dflash.models.dtypes import dtype_of
from dflash.models.target import default_layer_ids, load_target
from dflash.spec.load import load_spec


REPO = Path(__file__).resolve().parents[2]


def random_models(device: str, drafter_layers: int, block: int, target_layers: int = 30,
                  dtype=torch.bfloat16, seed: int = 0):
    """SmolLM2-135M's architecture with random weights (bf16; ``seed`` draws them), and a random
    drafter (``target_layers`` < 30: a shallower stack of the same layers, for a CPU smoke run)."""

    torch.manual_seed(seed)
    tc = LlamaConfig(hidden_size=576, num_hidden_layers=target_layers, num_attention_heads=9,
                     num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                     max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                     pad_token_id=2)
    target = LlamaForCausalLM(tc).to(device=device, dtype=dtype).eval()

    cfg = DFlashConfig.from_target_config(tc, drafter_layers, block, 49151,
                                          default_layer_ids(target_layers, drafter_layers))
    drafter = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
    return target, drafter, [2], 2


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """MT-Bench-like lengths (first turns in SmolLM2's chat template: ~40-250 tokens)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(40, 250, (n,), generator=g).tolist()
    return [torch.randint(3, 49000, (L,), generator=g).tolist() for L in lens]


def real_models(spec_path: str, drafter_dir: str, device: str, n: int):
    spec = load_spec(spec_path, check_devices_present=False)
    tgt = load_target(spec.target, device, seed=spec.seed)
    drafter, _ = load_drafter(drafter_dir, device=device, dtype=dtype_of(spec.drafter.dtype))
    sets = load_eval_sets(spec, None, tgt.tokenizer, ["mtbench"], n)
    pad = tgt.tokenizer.pad_token_id
    eos = eos_ids_of(tgt)
    return tgt.model, drafter.eval(), eos, eos[0] if pad is None else pad, sets[0].prompts


def simulated_tau(target, drafter, prompts, max_new, eos) -> list[float | None]:
    dev = str(next(target.parameters()).device)
    emb = target.get_input_embeddings().weight.to(drafter.dtype)
    head = target.lm_head.weight.to(drafter.dtype)
    sim = simulate(target, drafter, emb, head, prompts, max_new, eos,
                   drafter.cfg.target_layer_ids, dev)
    return [summarize([c], drafter.cfg.block_size)["tau"] for c in sim["chains"]]


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", action="store_true", help="random SmolLM2-135M-shaped models")
    ap.add_argument("--target-layers", type=int, default=30, help="--random: target layers "
                    "(30 = SmolLM2-135M; fewer for a CPU smoke run)")
    ap.add_argument("--spec", help="spec of the target (and MT-Bench prompts)")
    ap.add_argument("--drafter", help="exported drafter folder (with --spec)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--hf-batches", default="1,4,16,64", help="where to time HF static generate")
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns to load")
    ap.add_argument("--min-prompts", type=int, default=16, help="prompts per batch size, at least")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--drafter-layers", type=int, default=1, help="--random: drafter layers")
    ap.add_argument("--block", type=int, default=16, help="--random: block size")
    ap.add_argument("--weights-seed", type=int, default=0,
                    help="--random: the seed of the weights (the prompts keep theirs): a second "
                         "run with another seed and the same compile caches times what a warm "
                         "cache saves a trained drafter's decoders")
    ap.add_argument("--sync-every", type=int, default=None)
    ap.add_argument("--verify-tokens", type=int, default=None,
                    help="tokens per verify (anchor + drafts; default the drafter's block)")
    ap.add_argument("--no-simulated", action="store_true", help="skip simulated τ")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a batch size (recorded in the JSON) when the run so far plus the "
                         "last batch size's wall time x 1.5 would pass this many seconds")
    ap.add_argument("--compile-scopes", default=None,
                    help="comma list of scope[:torch.compile mode], measured side by side "
                         f"({', '.join(COMPILE_SCOPES)}; default {DEFAULT_COMPILE_SCOPE}; "
                         "--smoke: all)")
    ap.add_argument("--compile-shapes", default=DEFAULT_COMPILE_SHAPES,
                    choices=list(COMPILE_SHAPES),
                    help="how every region's graphs follow the batch sizes and widths (one "
                         "value a run: the A/B is two runs, since graphs compiled one way in a "
                         "process serve the other way's equal shapes)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default: inductor on CUDA, eager on CPU; "
                         "--smoke: aot_eager on CPU)")
    ap.add_argument("--no-kernel-profile", action="store_true",
                    help="skip the profiler's kernel count of one step (replay ms stays)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke: random 2-layer target, 1-layer drafter, batches 1,2, "
                         "8 new tokens, every scope")
    ap.add_argument("--adaptive", action="store_true",
                    help="print the adaptive choice per batch (dflash.decode.adaptive.choose)")
    ap.add_argument("--adaptive-widths", default="",
                    help="narrower verify widths also timed per batch for the choice, e.g. 4,8 "
                         "(implies --adaptive)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    try:
        a.widths = [int(x) for x in a.adaptive_widths.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--adaptive-widths: {a.adaptive_widths!r} is not a list of integers")
    if any(w < 2 for w in a.widths):
        ap.error(f"--adaptive-widths: {a.adaptive_widths!r}: each width is at least 2")
    a.adaptive = a.adaptive or bool(a.widths)
    if a.smoke:
        a.random, a.target_layers, a.drafter_layers, a.block = True, 2, 1, 4
        a.batches, a.hf_batches, a.max_new, a.min_prompts, a.prompts = "1,2", "1", 8, 2, 4
        a.compile_scopes = a.compile_scopes or ",".join(COMPILE_SCOPES)
        if not torch.cuda.is_available():
            a.compile_backend = a.compile_backend or "aot_eager"
    if not a.random and not (a.spec and a.drafter):
        ap.error("give --random, or --spec and --drafter")
    a.scopes = {}
    for item in (a.compile_scopes or DEFAULT_COMPILE_SCOPE).split(","):
        scope, _, mode = item.strip().partition(":")
        if scope not in COMPILE_SCOPES:
            ap.error(f"--compile-scopes: {scope!r} is not one of {', '.join(COMPILE_SCOPES)}")
        a.scopes[item.strip()] = (scope, mode or None)
    return a


def simulated_for(a, target, drafter, prompts, n: int) -> tuple[list | None, str | None]:
    """Simulated τ of the first ``n`` prompts, once for every batch size (it does not depend on
    the batch), or why not: a narrower verify than the trained block caps real τ below what
    the simulation (which walks the whole block) reports, so a gap there is no serving gap."""
    if a.no_simulated:
        return None, "--no-simulated"
    if a.verify_tokens and a.verify_tokens < drafter.cfg.block_size:
        return None, (f"--verify-tokens {a.verify_tokens} < block {drafter.cfg.block_size}: "
                      f"simulated τ walks the whole block")
    return simulated_tau(target, drafter, prompts[:n], a.max_new, a.eos), None


class Budget:
    """``--budget-s``: a piece is skipped when the time spent plus 1.5 x its own wall time at
    the previous batch size would pass the budget (a piece never timed yet always runs)."""

    def __init__(self, seconds, t_start):
        self.seconds, self.t_start, self.last = seconds, t_start, {}

    def refuse(self, key) -> str | None:
        spent = time.time() - self.t_start
        est = 1.5 * self.last.get(key, 0.0)
        if self.seconds and spent + est > self.seconds:
            return (f"budget: {spent:.0f} s spent + 1.5 x {self.last[key]:.0f} s ({key} at the "
                    f"last batch size) > --budget-s {self.seconds:.0f}")  # key: "scope X" / "HF"
        return None


def _scope_row(r) -> dict:
    """One scope's figures at one batch size: per engine ms per step (wall: decode seconds /
    steps; steps: the decoder's step phase alone, prefill and harvest apart; replay: one
    captured step), compile seconds, kernels; the goal ratios."""
    eng = r["engine"]
    to, sp = eng["target_only"], eng["speculative"]
    row = {"target_only": to, "speculative": sp, "tau": r["tau"], "speedup": r["speedup"],
           "target_only_tokens_per_s": r["target_only_tokens_per_s"],
           "speculative_tokens_per_s": r["speculative_tokens_per_s"], "goal": goal(r),
           "lossless": r["lossless_evidence"]["lossless"],
           "spec_step_over_target_step": {"wall": sp["ms_per_step"] / to["ms_per_step"],
                                          "goal_at_most": 1 / 0.75}}
    if to.get("replay_ms") and sp.get("replay_ms"):
        row["spec_step_over_target_step"]["replay"] = sp["replay_ms"] / to["replay_ms"]
    if to.get("steps_ms_per_step") and sp.get("steps_ms_per_step"):  # prefill, harvest apart
        row["spec_step_over_target_step"]["steps"] = (sp["steps_ms_per_step"]
                                                      / to["steps_ms_per_step"])
    return row


def _pair(a, target, drafter, ps, b, scope, mode) -> dict:
    kw = {k: v for k, v in (("sync_every", a.sync_every), ("verify_tokens", a.verify_tokens),
                            ("compile", a.compile_backend), ("compile_mode", mode),
                            ("compile_shapes", a.compile_shapes)) if v}
    t0 = time.time()
    r = pair(target, drafter, ps, b, a.max_new, a.eos, compile_scope=scope,
             inspect=lambda dec: step_profile(dec, kernels=not a.no_kernel_profile), **kw)
    r["wall_s"] = {"pair": time.time() - t0}
    for name in ("target_only", "speculative"):
        e = r["engine"][name]
        e["ms_per_step"] = 1e3 * r[f"{name}_s"] / max(1, e["steps"])
        if e.get("waves"):  # the decoder's own per-wave clock: the wall split apart
            e["steps_ms_per_step"] = e["steps_ms"] / max(1, e["steps"])
            e["prefill_ms_per_wave"] = e["prefill_ms"] / e["waves"]
            e["harvest_ms_per_wave"] = e["harvest_ms"] / e["waves"]
    return r


def one_batch(a, target, drafter, ps, b, hf_b, sim, budget, save=None) -> dict | str:
    """Target-only vs speculative at batch ``b`` for every compile scope (+ HF static, + τ real
    vs simulated); the first scope that ran gives the row's top-level figures. -> the row, or
    why the batch size was skipped. ``save(partial)`` after every scope: a call cut by its
    time limit keeps what it measured."""
    t0, base, scopes, skipped = time.time(), None, {}, []
    for label, (scope, mode) in a.scopes.items():
        why = budget.refuse(f"scope {label}")
        if why:
            skipped.append({"scope": label, "reason": why})
            print(f"batch {b:3d} [{label}]: skipped ({why})", flush=True)
            continue
        t1 = time.time()
        try:
            r = _pair(a, target, drafter, ps, b, scope, mode)
        except Exception as e:  # noqa: BLE001 - one scope's failure is a result, not the end
            scopes[label] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            print(f"batch {b:3d}: scope {label} FAILED: {scopes[label]['error']}", flush=True)
            continue
        finally:
            budget.last[f"scope {label}"] = time.time() - t1
        scopes[label] = _scope_row(r)
        print(_scope_line(b, label, scopes[label]), flush=True)
        base = base or r
        if save is not None:
            save({"batch": b, "compile_scopes": scopes, "skipped_parts": skipped})
    if base is None:
        return "; ".join(f"{s['scope']}: {s['reason']}" for s in skipped) or "every scope failed"
    r = base
    r["compile_scope"], r["compile_scopes"], r["skipped_parts"] = \
        next(k for k in scopes if "error" not in scopes[k]), scopes, skipped
    why = budget.refuse("HF static") if b in hf_b else "not in --hf-batches"
    if why is None:
        t1 = time.time()
        r["hf_static"] = hf_static_generate(target, ps, b, a.max_new, a.eos, a.pad)
        budget.last["HF static"] = r["wall_s"]["hf_static"] = time.time() - t1
    elif b in hf_b:
        skipped.append({"hf_static": True, "reason": why})
        print(f"batch {b:3d} [HF static]: skipped ({why})", flush=True)
    if sim is not None:
        r["tau_gap"] = tau_gap(r["results"], sim[:len(ps)])
    r["tau_per_prompt"] = [x.tau for x in r["results"]]
    r.pop("results")
    r.pop("greedy")
    r.pop("served_results", None)
    r["goal"] = goal(r)
    r["wall_s"]["total"] = time.time() - t0
    return r


def adapt(a, target, drafter, ps, r) -> None:
    """``--adaptive``: the choice at this batch from the pair's measured ms per step, plus one
    speculative decode per ``--adaptive-widths`` width (narrower verifies; E(L) from the full
    block's served accept shares, which a narrower verify only truncates); sets ``r``'s
    ``adaptive``, ``choice`` and ``choice_speedup`` (1.0 for target-only) and prints them."""
    rec, b = r.get("adaptive"), r["batch"]
    if rec is None:
        print(f"batch {b:3d} [adaptive]: no step times measured, no choice", flush=True)
        return
    step_ms = {c["width"]: c["step_ms"] for c in rec["candidates"]}
    tok_s = {0: r["target_only_tokens_per_s"], max(step_ms): r["speculative_tokens_per_s"]}
    scope, mode = a.scopes[r["compile_scope"]]
    kw = {k: v for k, v in (("sync_every", a.sync_every), ("compile", a.compile_backend),
                            ("compile_mode", mode), ("compile_shapes", a.compile_shapes)) if v}
    compiled = {}  # width -> its decoder's compile seconds and graphs (compile_shapes' cost)
    for w in (w for w in a.widths if w < max(step_ms)):
        dec = Decoder(target, drafter, batch=b, max_len=max(len(p) for p in ps) + a.max_new,
                      max_new_tokens=a.max_new, eos_ids=a.eos, verify_tokens=w,
                      compile_scope=scope, **kw)
        res, sec = timed_decode(dec, ps)
        step_ms[w] = dec.stats["steps_ms"] / max(1, dec.stats["steps"])
        tok_s[w] = sum(len(x.tokens) for x in res) / sec
        compiled[str(w)] = {k: dec.stats.get(k) for k in ("compile_seconds", "graphs_compiled")}
        del dec
    rec = {**choose(b, step_ms, rec["accept_rate_by_position"], new_tokens=a.max_new),
           "accept_rate_by_position": rec["accept_rate_by_position"],
           "measured_tok_s": {str(w): v for w, v in tok_s.items()}, "widths_compiled": compiled}
    w = rec["choice"]
    r["adaptive"], r["choice"] = rec, "target-only" if w == 0 else f"speculative (verify {w})"
    r["choice_speedup"] = tok_s[w] / tok_s[0] if tok_s[0] else None
    cands = ", ".join(f"{c['width']}: {c['step_ms']:.3f} ms, {c['expected_tok_s']:.0f} tok/s "
                      f"expected, {tok_s[c['width']]:.0f} measured" for c in rec["candidates"])
    print(f"batch {b:3d} [adaptive]: choice {r['choice']}, speed-up of the choice "
          f"{r['choice_speedup'] or float('nan'):.3f} ({rec['why']}; widths {cands})", flush=True)


def _scope_line(b, label, s) -> str:
    to, sp = s["target_only"], s["speculative"]
    ratio = s["spec_step_over_target_step"]
    return (f"batch {b:3d} [{label}]: ms/step target-only {to['ms_per_step']:.3f} (replay "
            f"{to.get('replay_ms') or float('nan'):.3f}, {to.get('kernels', '?')} kernels, "
            f"compile {to.get('compile_seconds')} s), speculative {sp['ms_per_step']:.3f} "
            f"(replay {sp.get('replay_ms') or float('nan'):.3f}, {sp.get('kernels', '?')} "
            f"kernels, compile {sp.get('compile_seconds')} s); spec/target step wall "
            f"{ratio['wall']:.3f}, steps {ratio.get('steps', float('nan')):.3f}, replay "
            f"{ratio.get('replay', float('nan')):.3f} (goal <= 1.333); prefill ms/wave "
            f"{to.get('prefill_ms_per_wave', float('nan')):.1f} / "
            f"{sp.get('prefill_ms_per_wave', float('nan')):.1f}, harvest "
            f"{to.get('harvest_ms_per_wave', float('nan')):.1f} / "
            f"{sp.get('harvest_ms_per_wave', float('nan')):.1f}; speed-up "
            f"{s['speedup'] or float('nan'):.3f}")


def _line(r) -> str:
    ev, b = r["lossless_evidence"], r["batch"]
    gap = (r.get("tau_gap") or {}).get("warning")
    return (f"batch {b:3d}: target-only {r['target_only_tokens_per_s']:9.1f} tok/s "
            f"({r['engine']['target_only']['ms_per_step']:.2f} ms/step), speculative "
            f"{r['speculative_tokens_per_s']:9.1f} tok/s "
            f"({r['engine']['speculative']['ms_per_step']:.2f} ms/step, τ {r['tau']:.3f}, "
            f"speed-up {r['speedup']:.3f}), HF static "
            f"{(r.get('hf_static') or {}).get('tokens_per_s') or float('nan'):9.1f} tok/s; "
            f"checked {ev['emitted_checked']}, not argmax {ev['emitted_not_argmax']}, identical "
            f"{ev['identical_to_greedy']}/{ev['prompts']}, lossless {ev['lossless']}; "
            f"{r['wall_s']['total']:.0f} s" + (f"; WARNING {gap}" if gap else ""))


def main(argv=None) -> int:
    a = parse(argv)

    t_start = time.time()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.random:
        target, drafter, a.eos, a.pad = random_models(
            dev, a.drafter_layers, a.block, a.target_layers,
            torch.float32 if a.smoke and dev == "cpu" else torch.bfloat16, a.weights_seed)
        prompts = random_prompts(max(a.prompts, 64))
    else:
        target, drafter, a.eos, a.pad, prompts = real_models(a.spec, a.drafter, dev, a.prompts)
    batches = [int(x) for x in a.batches.split(",") if x]
    hf_b = {int(x) for x in a.hf_batches.split(",") if x}
    n_of = {b: min(len(prompts), max(b, a.min_prompts)) for b in batches}
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if dev == "cuda"
           else platform.processor(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__,
           "models": f"random SmolLM2-135M shape, {a.target_layers} target layers" if a.random
           else {"spec": a.spec, "drafter": a.drafter},
           "block_size": drafter.cfg.block_size, "drafter_layers": drafter.cfg.num_hidden_layers,
           "verify_tokens": a.verify_tokens or drafter.cfg.block_size,
           "max_new_tokens": a.max_new, "prompts_per_batch": n_of, "batches": [], "skipped": [],
           "wall_s": {"load": time.time() - t_start}}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    t1 = time.time()
    sim, why = simulated_for(a, target, drafter, prompts, max(n_of.values(), default=0))
    out["wall_s"]["simulated"], out["simulated_skipped"] = time.time() - t1, why
    budget = Budget(a.budget_s, t_start)
    out["compile_scopes"], out["compile_shapes"] = list(a.scopes), a.compile_shapes

    def save(partial):  # mid-batch: the scopes measured so far
        path.write_text(json.dumps({**out, "in_progress": partial}, indent=1, default=str))

    for b in batches:
        r = one_batch(a, target, drafter, prompts[:n_of[b]], b, hf_b, sim, budget, save)
        if isinstance(r, str):
            out["skipped"].append({"batch": b, "reason": r})
            print(f"batch {b:3d}: skipped ({r})", flush=True)
            continue
        print(_line(r), flush=True)
        if a.adaptive:
            adapt(a, target, drafter, prompts[:n_of[b]], r)
        out["batches"].append(r)
        path.write_text(json.dumps(out, indent=1, default=str))  # after every batch size
        if dev == "cuda":
            torch.cuda.empty_cache()
    out["seconds"] = time.time() - t_start
    out["compiled"] = compiled_totals(out["batches"])
    print(f"compiled: {out['compiled']['graphs']} graphs in {out['compiled']['seconds']:.1f} s "
          f"({a.compile_shapes} shapes)", flush=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    return 0


def compiled_totals(rows) -> dict:
    """What the run's decoders compiled, summed over batch sizes and engines (target-only, the
    full block, each --adaptive-widths width): seconds and dynamo graphs."""
    engines = [e for r in rows for e in (*r["engine"].values(),
                                         *(r.get("adaptive") or {}).get("widths_compiled",
                                                                       {}).values())]
    return {"seconds": round(sum(e.get("compile_seconds") or 0.0 for e in engines), 3),
            "graphs": sum(e.get("graphs_compiled") or 0 for e in engines),
            "engines": len(engines)}


if __name__ == "__main__":
    sys.exit(main())
