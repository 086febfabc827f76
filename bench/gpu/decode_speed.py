"""Decoding speed as serving sees it: target-only vs speculative tokens/s through the one decoder
(dflash.eval.decoder), HF static-cache ``generate`` in the same run, at batch 1, 4, 16, 64; τ real
vs simulated per prompt; the lossless counts and margins. Prints the table, writes JSON.

    # the integrator's measurement: the trained drafter, the real target, MT-Bench first turns
    PYTHONPATH=$PWD python bench/gpu/decode_speed.py --spec specs/smollm2-quality.yaml \\
        --drafter results/smollm2-quality/train/drafter --out bench/results/h200/decode_speed.json
    # development without weights: random SmolLM2-135M-shaped target and drafter, random prompts
    PYTHONPATH=$PWD python bench/gpu/decode_speed.py --random --out /tmp/decode_speed.json

With random weights acceptance is ~0 (τ ≈ 1): the figures then time the steps (ms per verify
step vs per one-token step), not a speed-up.
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

from dflash.data.generate import eos_ids_of
from dflash.eval.evalsets import load_eval_sets
from dflash.eval.serving import goal, hf_static_generate, pair, tau_gap
from dflash.eval.tau import simulate, summarize
from dflash.models.drafter import DFlashConfig, DFlashDrafter, load_drafter
from dflash.models.dtypes import dtype_of
from dflash.models.target import default_layer_ids, load_target
from dflash.spec import load_spec

REPO = Path(__file__).resolve().parents[2]


def random_models(device: str, drafter_layers: int, block: int):
    """SmolLM2-135M's architecture with random weights (bf16), and a random drafter."""
    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
                     tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                     max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                     pad_token_id=2)
    target = LlamaForCausalLM(tc).to(device=device, dtype=torch.bfloat16).eval()

    cfg = DFlashConfig.from_target_config(tc, drafter_layers, block, 49151,
                                          default_layer_ids(30, drafter_layers))
    drafter = DFlashDrafter(cfg).to(device=device, dtype=torch.bfloat16).eval()
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", action="store_true", help="random SmolLM2-135M-shaped models")
    ap.add_argument("--spec", help="spec of the target (and MT-Bench prompts)")
    ap.add_argument("--drafter", help="exported drafter folder (with --spec)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--hf-batches", default="1,4,16,64", help="where to time HF static generate")
    ap.add_argument("--prompts", type=int, default=80, help="MT-Bench first turns to load")
    ap.add_argument("--min-prompts", type=int, default=16, help="prompts per batch size, at least")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--drafter-layers", type=int, default=1, help="--random: drafter layers")
    ap.add_argument("--block", type=int, default=16, help="--random: block size")
    ap.add_argument("--sync-every", type=int, default=None)
    ap.add_argument("--verify-tokens", type=int, default=None,
                    help="tokens per verify (anchor + drafts; default the drafter's block)")
    ap.add_argument("--no-simulated", action="store_true", help="skip simulated τ")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.random:
        target, drafter, eos, pad = random_models(dev, a.drafter_layers, a.block)
        prompts = random_prompts(max(a.prompts, 64))
    elif a.spec and a.drafter:
        target, drafter, eos, pad, prompts = real_models(a.spec, a.drafter, dev, a.prompts)
    else:
        ap.error("give --random, or --spec and --drafter")
    batches = [int(x) for x in a.batches.split(",") if x]
    hf_b = {int(x) for x in a.hf_batches.split(",") if x}
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if dev == "cuda"
           else platform.processor(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__,
           "models": "random SmolLM2-135M shape" if a.random else {"spec": a.spec,
                                                                   "drafter": a.drafter},
           "block_size": drafter.cfg.block_size, "drafter_layers": drafter.cfg.num_hidden_layers,
           "verify_tokens": a.verify_tokens or drafter.cfg.block_size,
           "max_new_tokens": a.max_new, "batches": [], "started": time.time()}
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    kw = {k: v for k, v in (("sync_every", a.sync_every), ("verify_tokens", a.verify_tokens))
          if v}
    for b in batches:
        ps = prompts[:max(b, a.min_prompts)]
        r = pair(target, drafter, ps, b, a.max_new, eos, **kw)
        for name, res in (("target_only", r["greedy"]), ("speculative", r["results"])):
            steps = r["engine"][name]["steps"]
            r["engine"][name]["ms_per_step"] = 1e3 * r[f"{name}_s"] / max(1, steps)
        if b in hf_b:
            r["hf_static"] = hf_static_generate(target, ps, b, a.max_new, eos, pad)
        if b == 1 and not a.no_simulated:
            r["tau_gap"] = tau_gap(r["results"], simulated_tau(target, drafter, ps, a.max_new,
                                                                eos))
        r["tau_per_prompt"] = [x.tau for x in r["results"]]
        r.pop("results")
        r.pop("greedy")
        r["goal"] = goal(r)
        out["batches"].append(r)
        ev = r["lossless_evidence"]
        print(f"batch {b:3d}: target-only {r['target_only_tokens_per_s']:9.1f} tok/s "
              f"({r['engine']['target_only']['ms_per_step']:.2f} ms/step), speculative "
              f"{r['speculative_tokens_per_s']:9.1f} tok/s "
              f"({r['engine']['speculative']['ms_per_step']:.2f} ms/step, τ {r['tau']:.3f}), "
              f"HF static {(r.get('hf_static') or {}).get('tokens_per_s') or float('nan'):9.1f}"
              f" tok/s; checked {ev['emitted_checked']}, not argmax {ev['emitted_not_argmax']},"
              f" identical {ev['identical_to_greedy']}/{ev['prompts']}", flush=True)
        path.write_text(json.dumps(out, indent=1, default=str))  # after every batch size
        del r
        if dev == "cuda":
            torch.cuda.empty_cache()
    out["seconds"] = time.time() - out.pop("started")
    path.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
