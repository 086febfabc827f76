"""The isolated target forward on one GPU: plain HF against our feature extractor, same run.

For each model (random weights, real architecture, bf16) on one device, with the bf16 matmul
peak measured in the same process:

* ``hf_plain``: plain transformers, SDPA, ``B × S`` causal batch, ``output_hidden_states=True``
  (the users' anchor: Qwen3-8B 26–31 K tok/s, Qwen3-32B 7.2–7.8 K tok/s on one H200);
* ``ours_flex``: :class:`dflash.models.features.FeatureExtractor` as the train stage runs it on CUDA
  (FlexAttention + document BlockMask) on ONE packed row of the same B documents of S tokens,
  every layer of the model, feature layers captured;
* ``ours_dense_sdpa``: the same packed row with SDPA and the dense 4-D document mask (the path
  the target workers used before: SDPA leaves its flash kernel and computes all L² scores);
* ``ours_flex_truncated``: what training ran before ``target.compile``: layers up to the last
  feature layer, eager;
* ``ours_flex_compiled`` / ``ours_flex_compiled_truncated``: the same two with the decoder layers
  compiled by inductor (``target.compile``, regional: one graph shared by every layer) — what
  training runs on CUDA now. They reuse the eager path's loaded model; the JSON records the
  first call's seconds (the compile, cold cache) and dynamo's graph count (1 expected).

``attention``: one layer's attention alone on the packed row (the target's q/k/v shapes):
compiled flex attention with its default kernel options and with 128×128 tiles, and
``torch.nn.attention.varlen.varlen_attn`` (flash varlen over the documents' cumulative
lengths), each with its TFLOP/s of useful (causal, per-document) attention FLOPs; a variant this
torch cannot run records its error.

Also ``mask_seconds``: building the document BlockMask for the row alone (eager, as the
extractor does; and ``create_block_mask(_compile=True)``), since a faster forward makes it a
larger share.

MFU counts useful FLOPs only (:func:`dflash.train.flops.target_flops`: causal attention inside each
document). Ratios are taken within the run.

    python -m bench.gpu.target_anchor --models qwen3-8b qwen3-32b --out $OUT/target_anchor.json
    python -m bench.gpu.target_anchor --models qwen3-8b --out $OUT/target_anchor.json \
        --paths hf_plain ours_flex_truncated ours_flex_compiled_truncated   # ~2 min
"""
from __future__ import annotations

import argparse
import inspect
import json
import time

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash.models.drafter import head_dim_of
from dflash.models.masks import document_block_mask, document_mask_mod
from dflash.models.features import FeatureExtractor
from dflash.models.target import hf_config, layer_ids, load_target
from dflash.runtime.tracing import worker_thread_setup
from dflash.spec.load import section_spec
from dflash.train.flops import best_seconds_per_call as timed
from dflash.train.flops import measure_peak_flops, target_flops

PATHS = ("hf_plain", "ours_dense_sdpa", "ours_flex", "ours_flex_truncated",
         "ours_flex_compiled", "ours_flex_compiled_truncated", "attention")


def record(c: dict, name: str, seconds: float, layers: int) -> None:
    """One path's seconds per forward as tokens/s and MFU in ``c["out"]``."""
    fl = target_flops(c["cfg"], layers, [c["seq"]] * c["batch"])
    tokens = c["tokens"]
    c["out"][name] = {"seconds": round(seconds, 5), "tokens_per_s": round(tokens / seconds, 1),
                      "layers_run": layers, "mfu": round(fl / seconds / c["peak"], 4)}
    print(f"[anchor] {c['model']} {name}: {tokens / seconds:,.0f} tok/s, "
          f"MFU {fl / seconds / c['peak']:.1%} ({layers} layers)", flush=True)


def hf_paths(c: dict, spec_target, input_ids: torch.Tensor, paths) -> None:
    """1. plain HF, the full model's decoder, all hidden states; 2. our extractor on the same
    weights with a packed row and a dense mask (SDPA)."""
    device, iters, n_layers = c["device"], c["iters"], c["cfg"].num_hidden_layers
    xi, di, pi = c["xi"], c["di"], c["pi"]
    t = load_target(spec_target, device, need_tokenizer=False)
    base = t.model.get_decoder()
    x = input_ids.to(device)
    if "hf_plain" in paths:
        with torch.no_grad():
            record(c, "hf_plain", timed(lambda: base(  # noqa: F821 (base is deleted below)
                input_ids=x, output_hidden_states=True, use_cache=False), device, iters, warmup=2),
                   n_layers)
    if "ours_dense_sdpa" in paths:  # same weights, packed row, dense mask (SDPA)
        fx = FeatureExtractor(t)
        record(c, "ours_dense_sdpa", timed(lambda: fx(xi, di, pi), device, iters,  # noqa: F821
                                           warmup=2), n_layers)  # (fx is deleted below)
        del fx
    del t, base
    torch.cuda.empty_cache()


def flex_paths(c: dict, spec_target, layers: int, eager_name: str, comp_name: str,
               paths) -> None:
    """3. our CUDA path at ``layers`` layers: FlexAttention + document BlockMask, the model
    loaded once, compiled (target.compile) then eager on the same weights; their features
    compared."""
    device, iters, out = c["device"], c["iters"], c["out"]
    xi, di, pi = c["xi"], c["di"], c["pi"]
    features: dict = {}  # the first path's features, to compare the second with
    t = load_target(spec_target, device, need_tokenizer=False,
                    num_layers=layers, attention="flex")
    # compiled first: the eager extractor's forward hooks stay on the layers afterwards
    for name, backend in ((comp_name, "inductor"), (eager_name, None)):
        if name not in paths:
            continue
        fx = FeatureExtractor(t, compile=backend)
        graphs = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        first = fx(xi, di, pi)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        out[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)  # incl. compiles
        if backend:
            out[f"{name}_new_graphs"] = counters["stats"]["unique_graphs"] - graphs
        other = features.pop(layers, None)
        if other is None:
            features[layers] = first
        else:  # compiled vs eager features (bf16: summation order only)
            diff = (first - other).float()
            out[f"{comp_name}_max_abs_diff_vs_eager"] = round(float(diff.abs().max()), 4)
            out[f"{comp_name}_rel_l2_diff_vs_eager"] = round(
                float(diff.norm() / other.float().norm()), 6)
            del other, diff
        del first
        record(c, name, timed(lambda: fx(xi, di, pi), device, iters, warmup=1),  # noqa: F821
               layers)
        del fx
    del t
    features.clear()
    torch.cuda.empty_cache()


RATIOS = (("ours_flex", "hf_plain"), ("ours_dense_sdpa", "hf_plain"),
          ("ours_flex", "ours_dense_sdpa"), ("ours_flex_compiled", "hf_plain"),
          ("ours_flex_compiled", "ours_flex"),
          ("ours_flex_compiled_truncated", "ours_flex_truncated"))


def measure(model_name: str, batch: int, seq: int, device: str, peak: float, iters: int,
            paths=PATHS) -> dict:
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
    xi, di, pi = input_ids.reshape(-1).to(device), doc.to(device), pos.to(device)
    c = {"model": model_name, "cfg": cfg, "batch": batch, "seq": seq, "tokens": tokens,
         "device": device, "peak": peak, "iters": iters, "out": out, "xi": xi, "di": di,
         "pi": pi}
    if "hf_plain" in paths or "ours_dense_sdpa" in paths:
        hf_paths(c, spec_target, input_ids, paths)
    for layers, eager_name, comp_name in ((n_layers, "ours_flex", "ours_flex_compiled"),
                                          (max(ids) + 1, "ours_flex_truncated",
                                           "ours_flex_compiled_truncated")):
        if eager_name in paths or comp_name in paths:
            flex_paths(c, spec_target, layers, eager_name, comp_name, paths)
    # the document BlockMask alone: from the documents' intervals (what the extractor builds per
    # row) and torch's compiled create_block_mask over the same rule (the path it replaced)
    L = di.shape[0]
    out["mask_seconds"] = {
        "intervals": round(timed(lambda: document_block_mask(di), device, iters, warmup=1), 5),
        "compiled": round(timed(lambda: create_block_mask(
            document_mask_mod(di), B=None, H=None, Q_LEN=L, KV_LEN=L, device=di.device,
            BLOCK_SIZE=128, _compile=True), device, iters, warmup=2), 5)}
    print(f"[anchor] {model_name} document BlockMask: {out['mask_seconds']}", flush=True)
    if "attention" in paths:
        out["attention"] = attention_variants(cfg, di, [seq] * batch, device, iters)
        print(f"[anchor] {model_name} attention alone: {out['attention']}", flush=True)
    for a, b in RATIOS:
        if a in out and b in out:
            out[f"ratio_{a}_vs_{b}"] = round(out[a]["tokens_per_s"] / out[b]["tokens_per_s"], 3)
    return out


def attention_variants(cfg, doc, doc_lengths: list[int], device: str, iters: int) -> dict:
    """One layer's attention on the packed row, per kernel: seconds and useful TFLOP/s."""
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim_of(cfg)
    L = doc.shape[0]
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, L, h, hd, device=device, dtype=torch.bfloat16, generator=g)
               .transpose(1, 2) for h in (hq, hkv, hkv))
    flops = sum(4 * n * (n + 1) / 2 * hd * hq for n in doc_lengths)  # QK^T and PV, causal
    mask = document_block_mask(doc)
    flex = torch.compile(flex_attention, dynamic=False)
    res: dict = {}

    def run(name: str, fn) -> None:
        try:
            sec = timed(fn, device, iters, warmup=2)
            res[name] = {"seconds": round(sec, 6), "tflops": round(flops / sec / 1e12, 1)}
        except Exception as e:  # noqa: BLE001 - a variant this torch/GPU cannot run
            res[name] = {"error": f"{type(e).__name__}: {str(e).strip()[:200]}"}

    for name, opts in (("flex_default", None), ("flex_128x128", {"BLOCK_M": 128, "BLOCK_N": 128})):
        run(name, lambda opts=opts: flex(q, k, v, block_mask=mask, scale=hd ** -0.5,
                                         enable_gqa=hq != hkv, kernel_options=opts))
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 - a probe: newer torch only
    except ImportError as e:
        res["varlen"] = {"error": f"ImportError: {e}"}
        return res
    params = inspect.signature(varlen_attn).parameters
    cu = torch.tensor([0] + doc_lengths, device=device).cumsum(0).to(torch.int32)
    qv, kv, vv = (t.transpose(1, 2)[0] for t in (q, k, v))  # [L, heads, D]
    kw: dict = {"scale": hd ** -0.5}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal
    if hq != hkv and "enable_gqa" in params:
        kw["enable_gqa"] = True
    elif hq != hkv:  # an older varlen without GQA: K/V repeated (the copy is not timed)
        kv, vv = (t.repeat_interleave(hq // hkv, dim=1) for t in (kv, vv))
    m = max(doc_lengths)
    run("varlen", lambda: varlen_attn(qv, kv, vv, cu, cu, m, m, **kw))
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["qwen3-8b"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    worker_thread_setup()  # as training: a compile failure or recompile limit raises, never eager
    peak = measure_peak_flops(a.device, torch.bfloat16)
    print(f"[anchor] bf16 matmul peak {peak['flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    res = {"peak": peak, "device": (torch.cuda.get_device_name(a.device)
                                    if a.device.startswith("cuda") else a.device),
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "runs": []}
    for m in a.models:
        res["runs"].append(measure(m, a.batch, a.seq, a.device, peak["flops_per_s"], a.iters,
                                   a.paths))
        with open(a.out, "w") as f:  # after each model: a later OOM or timeout keeps the first
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
