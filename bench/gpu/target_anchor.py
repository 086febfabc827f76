"""The isolated target forward on one GPU: plain HF against our feature extractor, same run.

For each model (random weights, real architecture, bf16) on one device, with the bf16 matmul
peak measured in the same process:

* ``hf_plain``: plain transformers, SDPA, ``B × S`` causal batch, ``output_hidden_states=True``
  (the users' anchor: Qwen3-8B 26–31 K tok/s, Qwen3-32B 7.2–7.8 K tok/s on one H200);
* ``ours_flex``: :class:`dflash.target.FeatureExtractor` as the train stage runs it on CUDA
  (FlexAttention + document BlockMask) on ONE packed row of the same B documents of S tokens,
  every layer of the model, feature layers captured;
* ``ours_dense_sdpa``: the same packed row with SDPA and the dense 4-D document mask (the path
  the target workers used before: SDPA leaves its flash kernel and computes all L² scores);
* ``ours_flex_truncated``: what training actually runs: layers up to the last feature layer.

MFU counts useful FLOPs only (:func:`dflash.flops.target_flops`: causal attention inside each
document). Ratios are taken within the run.

    python bench/gpu/target_anchor.py --models qwen3-8b qwen3-32b --out $OUT/target_anchor.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch


PATHS = ("hf_plain", "ours_dense_sdpa", "ours_flex", "ours_flex_truncated")


def measure(model_name: str, batch: int, seq: int, device: str, peak: float, iters: int,
            paths=PATHS) -> dict:
    from dflash.flops import best_seconds_per_call as timed, target_flops
    from dflash.spec import section_spec
    from dflash.target import FeatureExtractor, hf_config, layer_ids, load_target

    spec_target = section_spec("target", {"model": model_name, "init": "random",
                                          "dtype": "bfloat16", "num_feature_layers": 5})
    cfg = hf_config(spec_target)
    n_layers = cfg.num_hidden_layers
    ids = layer_ids(spec_target, cfg)
    tokens = batch * seq
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, cfg.vocab_size, (batch, seq), generator=g)
    doc = torch.arange(batch).repeat_interleave(seq)
    pos = torch.arange(seq).repeat(batch)
    out: dict = {"model": model_name, "batch": batch, "seq": seq, "tokens": tokens,
                 "layers": n_layers, "feature_layers": ids}

    def record(name: str, seconds: float, layers: int) -> None:
        fl = target_flops(cfg, layers, [seq] * batch)
        out[name] = {"seconds": round(seconds, 5), "tokens_per_s": round(tokens / seconds, 1),
                     "layers_run": layers, "mfu": round(fl / seconds / peak, 4)}
        print(f"[anchor] {model_name} {name}: {tokens / seconds:,.0f} tok/s, "
              f"MFU {fl / seconds / peak:.1%} ({layers} layers)", flush=True)

    # 1. plain HF, full model's decoder, all hidden states
    xi, di, pi = input_ids.reshape(-1).to(device), doc.to(device), pos.to(device)
    if "hf_plain" in paths or "ours_dense_sdpa" in paths:
        t = load_target(spec_target, device, need_tokenizer=False)
        base = t.model.get_decoder()
        x = input_ids.to(device)
        if "hf_plain" in paths:
            with torch.no_grad():
                record("hf_plain", timed(lambda: base(input_ids=x, output_hidden_states=True,
                                                      use_cache=False), device, iters, warmup=2),
                       n_layers)
        if "ours_dense_sdpa" in paths:  # same weights, packed row, dense mask (SDPA)
            fx = FeatureExtractor(t)
            record("ours_dense_sdpa", timed(lambda: fx(xi, di, pi), device, iters,  # noqa: F821
                                            warmup=2), n_layers)  # (fx is deleted below)
            del fx
        del t, base
        torch.cuda.empty_cache()
    # 3. our CUDA path: FlexAttention + document BlockMask, all layers then truncated
    for name, layers in (("ours_flex", n_layers), ("ours_flex_truncated", max(ids) + 1)):
        if name not in paths:
            continue
        t = load_target(spec_target, device, need_tokenizer=False,
                        num_layers=layers, attention="flex")
        fx = FeatureExtractor(t)
        t0 = time.perf_counter()
        fx(xi, di, pi)
        torch.cuda.synchronize(device)
        out[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)  # incl. flex compile
        record(name, timed(lambda: fx(xi, di, pi), device, iters, warmup=1), layers)  # noqa: F821
        del fx, t
        torch.cuda.empty_cache()
    for a, b in (("ours_flex", "hf_plain"), ("ours_dense_sdpa", "hf_plain"),
                 ("ours_flex", "ours_dense_sdpa")):
        if a in out and b in out:
            out[f"ratio_{a}_vs_{b}"] = round(out[a]["tokens_per_s"] / out[b]["tokens_per_s"], 3)
    return out


def main() -> None:
    from dflash.flops import measure_peak_flops

    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["qwen3-8b"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    peak = measure_peak_flops(a.device, torch.bfloat16)
    print(f"[anchor] bf16 matmul peak {peak['flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    res = {"peak": peak, "device": torch.cuda.get_device_name(a.device),
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "runs": []}
    for m in a.models:
        res["runs"].append(measure(m, a.batch, a.seq, a.device, peak["flops_per_s"], a.iters,
                                   a.paths))
        with open(a.out, "w") as f:  # after each model: a later OOM or timeout keeps the first
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
