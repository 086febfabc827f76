"""New tokens/s of the target's generation: plain HF ``generate``, the data stage's old HF loop
(``dflash.decode.generate.generate_batch``) and the fast engine (``dflash.decode.engine.Engine``), on the same
prompts, in one process.

Prompts are real: chatterbot-corpus first turns through the target's chat template, repeated
with distinct seeds (sampled answers, like ``data.samples_per_prompt``) until ``--prompts``.
The HF baselines run on a subset (``--hf-prompts``, ``--loop-prompts``) and report tokens/s, so
the whole run stays short; their first (warm-up) batch is timed separately. The engine's
compile + capture time is reported apart from its generation time.

    # H200 (defaults: SmolLM2-135M-Instruct bf16, 8192 prompts, <= 256 new tokens, 1024 slots)
    PYTHONPATH=. python -m bench.gen_throughput --out bench/results/h200/gen_throughput.json
    # CPU smoke
    PYTHONPATH=. python -m bench.gen_throughput --device cpu --dtype float32 --prompts 32 \
        --max-new 32 --slots 16 --hf-prompts 16 --hf-batch 16 --loop-prompts 16 \
        --out bench/results/cpu/gen_throughput_smoke.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import transformers

from bench.entry import write_result
from dflash.decode.engine import Engine
from dflash.decode.generate import eos_ids_of, generate_batch, sample_seed
from dflash.data.prompts import load_prompts, render_prompt
from dflash.models.target import load_target


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def workload(tok, n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """``n`` (prompt ids, seed): chatterbot prompts cycled, each repeat a new sample seed;
    sorted by prompt length like the data stage's chunks."""
    prompts, _ = load_prompts("chatterbot-corpus", 10 ** 6, seed, 0.05)
    rendered = [render_prompt(tok, p.messages) for p in prompts]
    items = [(rendered[i % len(rendered)], sample_seed(seed, i)) for i in range(n)]
    items.sort(key=lambda x: len(x[0]))
    return [p for p, _ in items], [s for _, s in items]


def run_hf_generate(model, prompts, seeds, a, eos, pad, device) -> dict:
    """Plain ``model.generate``: left-padded batches of ``--hf-batch``; first batch = warm-up."""
    def batch(ps):
        P = max(len(p) for p in ps)
        ids = torch.full((len(ps), P), pad, dtype=torch.long)
        att = torch.zeros((len(ps), P), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, P - len(p):] = torch.tensor(p)
            att[i, P - len(p):] = 1
        kw = dict(do_sample=a.temperature > 0, max_new_tokens=a.max_new, pad_token_id=pad,
                  eos_token_id=eos)
        if a.temperature > 0:
            kw.update(temperature=a.temperature, top_k=0, top_p=1.0)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), **kw)
        new = 0
        for row in out[:, P:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            new += n
        return new

    torch.manual_seed(0)
    t0 = time.time()
    warm = batch(prompts[:min(len(prompts), a.hf_batch)])
    _sync(device)
    warm_s = time.time() - t0
    new, t0 = 0, time.time()
    for i in range(0, len(prompts), a.hf_batch):
        new += batch(prompts[i:i + a.hf_batch])
    _sync(device)
    s = time.time() - t0
    return {"prompts": len(prompts), "batch": a.hf_batch, "new_tokens": new,
            "seconds": round(s, 3), "new_tokens_per_s": round(new / s, 1),
            "warmup_batch_seconds": round(warm_s, 3),
            "warmup_batch_new_tokens_per_s": round(warm / warm_s, 1)}


def run_loop(model, prompts, seeds, a, eos, pad, device) -> dict:
    """The data stage's former path (``dflash.decode.generate.generate_batch``), batches of --hf-batch."""
    t0 = time.time()
    new = 0
    for i in range(0, len(prompts), a.hf_batch):
        out = generate_batch(model, prompts[i:i + a.hf_batch], a.max_new, a.temperature, eos, pad,
                             seeds[i:i + a.hf_batch])
        new += sum(len(r) for r in out)
    _sync(device)
    s = time.time() - t0
    return {"prompts": len(prompts), "batch": a.hf_batch, "new_tokens": new,
            "seconds": round(s, 3), "new_tokens_per_s": round(new / s, 1)}


def _onoff(v: str):
    return None if v == "auto" else v == "on"


def run_engine(model, prompts, seeds, a, eos, slots: int, device, attention: str = "sdpa"
               ) -> dict:
    t0 = time.time()
    eng = Engine(model, slots=slots, max_len=max(len(p) for p in prompts) + a.max_new,
                 max_new_tokens=a.max_new, eos_ids=eos, temperature=a.temperature,
                 compile=_onoff(a.compile), cuda_graph=_onoff(a.graph),
                 padded_prefill=_onoff(a.padded_prefill), attention=attention,
                 sync_every=a.sync_every, prefill_batch=a.prefill_batch)
    eng.prepare()
    _sync(device)
    prep = time.time() - t0
    t0 = time.time()
    out = eng.generate(prompts, seeds)
    _sync(device)
    s = time.time() - t0
    new = sum(len(r) for r in out)
    st = eng.stats
    # where the time went: one decode step alone (the same work with every slot idle), so
    # decode_steps × step_ms is the decode share and the rest is prefill/refill/host
    reps = 32
    steps_before = st["decode_steps"]

    t1 = time.time()
    with torch.inference_mode():
        eng._replay(reps)
    _sync(device)
    step_ms = (time.time() - t1) / reps * 1e3
    st["decode_steps"] = steps_before
    return {"slots": slots, "attention": attention, "padded_prefill": eng.padded_prefill,
            "prefill_batch": eng.prefill_batch, "prefill_graphs": len(eng.prefill.graphs),
            "prompts": len(prompts), "new_tokens": new, "seconds": round(s, 3),
            "new_tokens_per_s": round(new / s, 1),
            "setup_seconds": round(prep, 3), "compile_seconds": st["compile_seconds"],
            "capture_seconds": st["capture_seconds"], "cache_len": eng.S,
            "compiled": bool(eng.compile), "cuda_graph": eng.settings()["cuda_graph"],
            "sync_every": eng.sync_every, "decode_steps": st["decode_steps"],
            "prefill_calls": st["prefill_calls"],
            "prefill_seconds": round(st["prefill_seconds"], 3),
            "slot_utilisation": round(new / max(1, st["decode_steps"] * slots + len(prompts)), 4),
            "mean_answer_tokens": round(new / len(prompts), 1),
            "decode_step_ms": round(step_ms, 3),
            "decode_share_of_time": round(st["decode_steps"] * step_ms / 1e3 / s, 3),
            "decode_bound_new_tokens_per_s": round(slots / step_ms * 1e3, 1),
            "graph_error": st.get("graph_error")}, out


def greedy_check(target, prompts, a, eos, pad, device) -> dict:
    """Greedy engine answers (compiled + captured as configured) vs HF greedy, one prompt at a
    time, on a float32 copy of the target (in bf16 the rounding differs between batch
    compositions, so two exact implementations may part ways late in a long answer)."""
    model = load_target(dict(target, dtype="float32"), device, need_tokenizer=False).model

    eng = Engine(model, slots=min(len(prompts), 8), max_len=max(map(len, prompts)) + a.max_new,
                 max_new_tokens=a.max_new, eos_ids=eos, compile=_onoff(a.compile),
                 cuda_graph=_onoff(a.graph), padded_prefill=_onoff(a.padded_prefill),
                 attention=a.attention.split(",")[0])
    ours = eng.generate(prompts)
    same, prefix, parted = 0, [], []
    for p, o in zip(prompts, ours):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([p], device=device), do_sample=False,
                                 max_new_tokens=a.max_new, pad_token_id=pad,
                                 eos_token_id=eos)[0, len(p):].tolist()
        n = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        ref = ref[:n]
        same += o == ref
        k = next((i for i, (x, y) in enumerate(zip(o, ref)) if x != y), min(len(o), len(ref)))
        prefix.append(k / max(1, len(ref)))
        if o != ref and k < min(len(o), len(ref)):
            # where the two part: HF's own logits there. A gap near zero is a near-tie that
            # summation order decides (both implementations exact); a large one would be a bug.
            with torch.inference_mode():
                lg = model(torch.tensor([list(p) + ref[:k]], device=device)).logits[0, -1]
            parted.append({"at": k, "of": len(ref), "hf": ref[k], "ours": o[k],
                           "logit_gap": round(float(lg[ref[k]] - lg[o[k]]), 6),
                           "hf_top2_gap": round(float(lg.topk(2).values[0]
                                                      - lg.topk(2).values[1]), 6)})
    return {"dtype": "float32", "prompts": len(prompts), "identical": same, "parted": parted,
            "mean_common_prefix_fraction": round(sum(prefix) / len(prefix), 4)}


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--prompts", type=int, default=8192)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--slots", default="1024", help="comma-separated slot counts to measure")
    ap.add_argument("--sync-every", type=int, default=None)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--graph", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--padded-prefill", choices=["auto", "on", "off"], default="auto",
                    help="fixed-shape prefill, one CUDA graph per length (auto: with --graph)")
    ap.add_argument("--prefill-batch", type=int, default=None)
    ap.add_argument("--attention", default="sdpa",
                    help="decode attention(s) to measure, comma-separated: sdpa, matmul")
    ap.add_argument("--hf-prompts", type=int, default=1024, help="HF generate subset (0: skip)")
    ap.add_argument("--hf-batch", type=int, default=256)
    ap.add_argument("--loop-prompts", type=int, default=256,
                    help="subset for the old data-stage loop (0: skip)")
    ap.add_argument("--check", type=int, default=8,
                    help="greedy check vs HF on N prompts (float32 copy; 0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    target = {"model": a.model, "init": "pretrained", "dtype": dtype, "num_feature_layers": 1,
              "layer_ids": None}
    t0 = time.time()
    tgt = load_target(target, a.device, seed=a.seed)
    load_s = time.time() - t0
    eos = eos_ids_of(tgt)
    pad = tgt.tokenizer.pad_token_id if tgt.tokenizer.pad_token_id is not None else eos[0]
    prompts, seeds = workload(tgt.tokenizer, a.prompts, a.seed)
    gpu = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else platform.processor()
    res: dict = {"model": a.model, "dtype": dtype, "device": a.device, "gpu": gpu,
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "cuda": torch.version.cuda, "python": platform.python_version(),
                 "prompts": a.prompts, "distinct_prompts": len({tuple(p) for p in prompts}),
                 "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
                 "max_new_tokens": a.max_new, "temperature": a.temperature,
                 "load_seconds": round(load_s, 2)}
    print(f"{a.model} {dtype} on {gpu}: {a.prompts} prompts (mean "
          f"{res['prompt_tokens_mean']} tokens), <= {a.max_new} new, T={a.temperature}",
          flush=True)

    # subsets spread over the length-sorted list (every k-th prompt), so lengths are alike
    def subset(n):
        step = max(1, len(prompts) // n)
        idx = list(range(0, len(prompts), step))[:n]
        return [prompts[i] for i in idx], [seeds[i] for i in idx]

    if a.hf_prompts:
        ps, ss = subset(a.hf_prompts)
        res["hf_generate"] = run_hf_generate(tgt.model, ps, ss, a, eos, pad, a.device)
        print(f"HF generate      : {res['hf_generate']}", flush=True)
    if a.loop_prompts:
        ps, ss = subset(a.loop_prompts)
        res["hf_loop"] = run_loop(tgt.model, ps, ss, a, eos, pad, a.device)
        print(f"old data loop    : {res['hf_loop']}", flush=True)
    res["engine"] = []
    for slots in [int(x) for x in a.slots.split(",")]:
        for attention in a.attention.split(","):
            r, _ = run_engine(tgt.model, prompts, seeds, a, eos, slots, a.device, attention)
            res["engine"].append(r)
            print(f"engine           : {r}", flush=True)
    best = max(res["engine"], key=lambda r: r["new_tokens_per_s"])
    res["engine_best_new_tokens_per_s"] = best["new_tokens_per_s"]
    for name in ("hf_generate", "hf_loop"):
        if name in res:
            res[f"ratio_vs_{name}"] = round(best["new_tokens_per_s"]
                                            / res[name]["new_tokens_per_s"], 2)
    if a.check:
        ps, _ = subset(a.check)
        res["greedy_check"] = greedy_check(target, ps, a, eos, pad, a.device)
        print(f"greedy vs HF     : {res['greedy_check']}", flush=True)
    print(json.dumps({k: v for k, v in res.items() if k.startswith(("ratio", "engine_best"))}))
    if a.out:
        write_result(a.out, res)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
