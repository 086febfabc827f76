"""Where the target's time per training row goes, and what the feature cache buys (issue #24).

Three measurements, each written to its own JSON under --out as soon as it is done:

* ``target_side_smollm2.json``: a SmolLM2-135M-shaped target (random weights, bf16, the
  training path: truncated after the last feature layer, flex BlockMask, compiled layers) on
  packed 8,192-token rows: per-row time of today's worker (H2D copies, mask, layers, then a
  device sync), the same rows queued without a sync per row, and the CUDA-graph path
  (:mod:`dflash.models.target_graph`); features of graph vs compiled (max |diff|); the host
  time it takes to enqueue each section; a torch.profiler table of one compiled row.
* ``feature_cache_8b.json``: the target side of a target-bound spec (Qwen3-8B shape, random
  weights, 16,384-token rows, HF forward with flex attention): epoch 0 = the target's forward
  + the cache's write, epochs >= 1 = the cache's read (host, bf16 and float8_e4m3), in rows/s
  and tokens/s, as the target worker runs them (one sync at the end).
* ``feature_cache_read.json``: the cache's read alone per row for both shapes.

``--smoke`` runs everything small on CPU (no graph) to check the script.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dflash.models.masks import attention_backend, document_block_mask, document_dense_mask
from dflash.models.features import FeatureExtractor
from dflash.models.target import hf_config, layer_ids, load_target
from dflash.models.target_graph import CapturedFeatures
from dflash.spec.load import section_spec
from dflash.train import cache_budget as cb
from dflash.train import feature_cache as fc
from dflash.train.packing import pack_row

SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576,
               intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
               rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
               bos_token_id=1, eos_token_id=2, pad_token_id=2)
TINY = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def config_dir(cfg: dict) -> str:
    d = tempfile.mkdtemp(prefix="target-shape-")
    Path(d, "config.json").write_text(json.dumps(cfg))
    return d


def rows(L: int, n: int, mean: int, vocab: int, seed: int):
    """``n`` packed rows of documents of 1/3..5/3 x ``mean`` tokens, then padding."""
    rnd = random.Random(seed)
    out, sid = [], 0
    for _ in range(n):
        docs, used = [], 0
        while True:
            k = rnd.randint(mean // 3, 5 * mean // 3)
            if used + k > L:
                break
            docs.append((sid, [rnd.randint(5, vocab - 1) for _ in range(k)], [1] * k))
            used, sid = used + k, sid + 1
        out.append((pack_row(docs, L, 0), docs))
    return out


def sync(dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def timed(dev, fn, reps):
    sync(dev)
    t = time.perf_counter()
    for i in range(reps):
        out = fn(i)
    host = time.perf_counter() - t
    sync(dev)
    return out, host, time.perf_counter() - t


def load(model: str, dev: str, compile: str | None, layers: int = 5):
    spec = section_spec("target", {"model": model, "init": "random", "dtype": "bfloat16"
                                   if dev.startswith("cuda") else "float32",
                                   "num_feature_layers": layers})
    ids = layer_ids(spec, hf_config(spec))
    t = load_target(spec, dev, num_layers=max(ids) + 1, need_tokenizer=False,
                    attention=attention_backend(dev))
    return FeatureExtractor(t, compile=compile), t


def synced_sections(fx, rs: list, to, dev: str, n: int, res: dict) -> None:
    """Today's worker, by section (host-to-device, mask, layers), each ending in a device sync
    to time it; per row, also the host's enqueue time."""
    secs = {"h2d": 0.0, "mask": 0.0, "layers": 0.0}
    host = {"mask": 0.0, "layers": 0.0}
    for r in rs:
        a = time.perf_counter()
        ids, doc, pos = to(r)
        sync(dev)
        b = time.perf_counter()
        mask = (document_block_mask(doc) if fx.target.attention == "flex"
                else document_dense_mask(doc))
        hb = time.perf_counter()
        sync(dev)
        c = time.perf_counter()
        with torch.no_grad():
            if fx.compile:
                fx._layers(ids[None], pos[None], mask)
            else:
                fx.base(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                        use_cache=False)
        hc = time.perf_counter()
        sync(dev)
        d = time.perf_counter()
        secs["h2d"] += b - a
        secs["mask"] += c - b
        secs["layers"] += d - c
        host["mask"] += hb - b
        host["layers"] += hc - c
    res["per_row_s_synced_sections"] = {k: round(v / n, 5) for k, v in secs.items()}
    res["per_row_host_enqueue_s"] = {k: round(v / n, 5) for k, v in host.items()}


def graph_rows(fx, rs: list, to, dev: str, L: int, n: int, res: dict) -> None:
    """CUDA: the rows through :class:`CapturedFeatures` (capture, equality with the compiled
    extractor, per-row seconds), the linear FLOPs, and a profile of one compiled row."""
    cap = CapturedFeatures(fx, dev)
    a = time.perf_counter()
    g0 = cap(rs[0].input_ids, rs[0].doc_ids, rs[0].position_ids)
    sync(dev)
    res["graph_capture_s"] = round(time.perf_counter() - a, 3)
    res["graph_captured"] = cap._graphs[L] is not None
    diffs = []
    for r in rs[:4]:
        g = cap(r.input_ids, r.doc_ids, r.position_ids)
        e = fx(*to(r))
        diffs.append(float((g.float() - e.float()).abs().max()))
    res["graph_vs_compiled_max_abs_diff"] = max(diffs)
    res["graph_vs_compiled_equal"] = max(diffs) == 0.0
    del g0
    _, h, w = timed(dev, lambda i: cap(rs[i].input_ids, rs[i].doc_ids, rs[i].position_ids),
                    n)
    res["graph_per_row_s"] = round(w / n, 5)
    res["graph_host_per_row_s"] = round(h / n, 5)
    _, h, w = timed(dev, lambda i: [cap(rs[i].input_ids, rs[i].doc_ids,
                                        rs[i].position_ids), sync(dev)], n)
    res["graph_synced_per_row_s"] = round(w / n, 5)
    flops = 2 * L * sum(p.numel() for p in fx.base.layers.parameters())
    res["tflop_per_row_linear"] = round(flops / 1e12, 3)
    res["target_tokens_per_s"] = {k: round(L / res[k]) for k in
                                  ("today_per_row_s", "nosync_per_row_s", "graph_per_row_s")}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fx(*to(rs[2]))
        sync(dev)
    ev = prof.key_averages()
    res["profile_compiled_row"] = {
        "cuda_kernels": sum(e.count for e in ev if e.device_type.name == "CUDA"),
        "top": [{"name": e.key[:80], "count": e.count,
                 "device_ms": round(e.self_device_time_total / 1e3, 3),
                 "cpu_ms": round(e.self_cpu_time_total / 1e3, 3)}
                for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]]}


def smollm2_profile(dev: str, cfg: dict, L: int, n: int, out: Path) -> dict:
    cuda = dev.startswith("cuda")
    t0 = time.perf_counter()
    fx, t = load(config_dir(cfg), dev, "inductor" if cuda else None)
    rs = [r for r, _ in rows(L, n, 260, cfg["vocab_size"], 0)]
    to = lambda r: (r.input_ids.to(dev), r.doc_ids.to(dev), r.position_ids.to(dev))  # noqa
    fx(*to(rs[0]))
    fx(*to(rs[1]))  # compiled (two layouts: any specialisation settles here)
    sync(dev)
    res = {"device": dev, "torch": torch.__version__, "row_tokens": L, "rows": n,
           "docs_per_row": sum(len(set(r.doc_ids.tolist())) - 1 for r in rs) / n,
           "layers_run": len(fx.base.layers), "feature_layers": fx.target.layer_ids,
           "load_and_compile_s": round(time.perf_counter() - t0, 2)}
    synced_sections(fx, rs, to, dev, n, res)
    _, h, w = timed(dev, lambda i: [fx(*to(rs[i])), sync(dev)], n)
    res["today_per_row_s"] = round(w / n, 5)  # the worker as it was: forward, then sync
    _, h, w = timed(dev, lambda i: fx(*to(rs[i])), n)
    res["nosync_per_row_s"] = round(w / n, 5)
    res["nosync_host_per_row_s"] = round(h / n, 5)
    if cuda:
        graph_rows(fx, rs, to, dev, L, n, res)
    (out / "target_side_smollm2.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "profile_compiled_row"}), flush=True)
    return res


def cache_ab(dev: str, model: str, L: int, n: int, out: Path, name: str) -> dict:
    """Epoch 0 (target + cache write) vs epochs >= 1 (cache read), on the target side."""
    t0 = time.perf_counter()
    fx, t = load(model, dev, None)
    H = t.config.hidden_size
    N = len(t.layer_ids)
    vocab = t.config.vocab_size
    packed = rows(L, n, 1200 if L > 8192 else 260, min(vocab, 49152), 1)
    samples = [d for _, docs in packed for d in docs]
    # epoch 1 re-packs the same samples: shuffle and refill rows of L
    rnd = random.Random(2)
    order = samples[:]
    rnd.shuffle(order)

    ep1, cur, used = [], [], 0
    for s in order:
        if used + len(s[1]) > L:
            ep1.append(pack_row(cur, L, 0))
            cur, used = [], 0
        cur.append(s)
        used += len(s[1])
    ep1.append(pack_row(cur, L, 0))
    to = lambda r: (r.input_ids.to(dev), r.doc_ids.to(dev), r.position_ids.to(dev))  # noqa
    fx(*to(packed[0][0]))  # flex attention compiles here
    sync(dev)
    res = {"command": " ".join(sys.argv), "device": dev, "model": name, "row_tokens": L,
           "rows_epoch0": n, "rows_epoch1": len(ep1), "feature_layers": N, "hidden": H,
           "load_s": round(time.perf_counter() - t0, 2),
           "real_tokens": sum(len(s[1]) for s in samples)}
    ids = [s[0] for s in samples]
    lens = [len(s[1]) for s in samples]
    for store in ("target", "float8_e4m3"):
        sdt = torch.bfloat16 if store == "target" else fc.FP8
        dt = torch.bfloat16 if dev.startswith("cuda") else torch.float32
        plane = cb.Plane("features", N * H, dt, sdt if store != "target" else dt, groups=N)
        cache = fc.FeatureCache([plane], ids, lens, tensor_values=True)
        # epoch 0: what the target worker does per row (forward, then the cache's write)
        _, h0, w0 = timed(dev, lambda i: cache.write(packed[i][0], fx(*to(packed[i][0]))), n)
        cache.flush()
        _, h1, w1 = timed(dev, lambda i: cache.read(ep1[i], dev), len(ep1))
        real0 = sum(int((r.doc_ids >= 0).sum()) for r, _ in packed)
        real1 = sum(int((r.doc_ids >= 0).sum()) for r in ep1)
        # the target alone, for reference (no write)
        _, _, wt = timed(dev, lambda i: fx(*to(packed[i][0])), n)
        res[store] = {"epoch0_tokens_per_s": round(real0 / w0), "epoch0_s_per_row": w0 / n,
                      "target_only_tokens_per_s": round(real0 / wt),
                      "epoch1_tokens_per_s": round(real1 / w1),
                      "epoch1_s_per_row": w1 / len(ep1),
                      "epoch1_host_s_per_row": h1 / len(ep1),
                      "speedup_epoch1_vs_epoch0": round((real1 / w1) / (real0 / w0), 2),
                      "store_bytes": sum(lens) * plane.bytes_per_token}
        cache.close(remove=True)
        print(name, store, json.dumps(res[store]), flush=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/h200"))
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="small shapes on CPU")
    ap.add_argument("--only", choices=["smollm2", "cache"], default=None)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if a.smoke:
        smollm2_profile("cpu", TINY, 512, 3, out)
        cache_ab("cpu", config_dir(TINY), 512, 3, out, "feature_cache_smoke")
        return 0
    if a.only in (None, "cache"):
        cache_ab(a.device, "qwen3-8b", 16384, 6, out, "feature_cache_8b")
    if a.only in (None, "smollm2"):
        smollm2_profile(a.device, SMOLLM2, 8192, 12, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
