"""The two BlockMask builds of a training step, from the rows' intervals (today) against torch's
``create_block_mask`` over the same rule (the path they replaced): the same tiles, and the
milliseconds each costs on the device.

* drafter: the objective's mask over a bucket of ``--seq`` tokens of ``--docs`` documents with
  ``--anchors`` block slots of ``--block`` tokens (the quality spec: 8,192 / 1,536 / 16);
  built as the captured step builds it, and once inside a CUDA graph (capture, then replays);
* target: the document mask of the same row.
For each, ``equal_tiles`` (partial and full tile lists identical to ``create_block_mask``'s) and
ms per build (best of ``--iters``, device-synchronised), and the first (cold) call's seconds of
the compiled ``create_block_mask``.

    python3 -m bench.gpu.mask_build --out $OUT/mask_build.json
    python3 -m bench.gpu.mask_build --device cpu --seq 512 --anchors 64 --out /tmp/mask.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask

from bench.entry import run, write_result
from bench.mask_tiles import add_bucket_args, bucket
from dflash.models.masks import (document_block_mask, document_mask_mod, flex_block_mask,
                                 make_mask_mod, mask_shape)


def timed_ms(fn, device: str, iters: int) -> float:
    """Best of ``iters`` calls, each ended by a device sync, in ms."""
    best = float("inf")
    for _ in range(iters):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 4)


def same_tiles(a, b) -> bool:
    """Partial and full tile lists of two BlockMasks equal (as sets per query tile)."""
    def dense(num, idx):
        # unlisted slots write into one spare column (a scatter with repeated indices has no
        # defined order on CUDA: round 7's target check read False from that, not the tiles)
        n = idx.shape[-1]
        keep = torch.arange(n, device=idx.device) < num[..., None]
        out = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
        return out.scatter(-1, torch.where(keep, idx.long(), n), True)[..., :n]
    return all(torch.equal(dense(*x), dense(*y)) for x, y in (
        ((a.kv_num_blocks, a.kv_indices), (b.kv_num_blocks, b.kv_indices)),
        ((a.full_kv_num_blocks, a.full_kv_indices), (b.full_kv_num_blocks, b.full_kv_indices))))


def compiled_reference(mask_mod, n, q_len, kv_len, device):
    """torch's create_block_mask, compiled, over the same rule; and its first call's seconds."""
    t = time.perf_counter()
    ref = create_block_mask(mask_mod, B=n, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device,
                            _compile=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return ref, round(time.perf_counter() - t, 3)


def drafter_arm(a, row, blocks) -> dict:
    doc = row.doc_ids.to(a.device)
    n, q_len, kv_len = mask_shape(doc, blocks)
    ours = flex_block_mask(doc, blocks, device=a.device)
    mm = make_mask_mod(doc, blocks.to(a.device))  # one closure: the compiled build's graph
    ref, cold_s = compiled_reference(mm, n, q_len, kv_len, a.device)
    out = {"q_len": q_len, "kv_len": kv_len, "equal_tiles": same_tiles(ours, ref),
           "tiles_listed": int(ours.kv_num_blocks.sum() + ours.full_kv_num_blocks.sum()),
           "tiles_total": int(ours.kv_indices.numel()),
           "intervals_ms": timed_ms(lambda: flex_block_mask(doc, blocks, device=a.device),
                                    a.device, a.iters),
           "create_block_mask_compiled_ms": timed_ms(
               lambda: create_block_mask(mm, B=n, H=None, Q_LEN=q_len, KV_LEN=kv_len,
                                         device=a.device, _compile=True), a.device, a.iters),
           "create_block_mask_first_s": cold_s}
    if a.device.startswith("cuda"):
        out["captured"] = captured_arm(doc, blocks, ref, a)
    return out


def captured_arm(doc, blocks, ref, a) -> dict:
    """The interval build inside a CUDA graph, as the captured training step runs it."""
    static = blocks.to(a.device)
    torch.cuda.synchronize()
    graph, t = torch.cuda.CUDAGraph(), time.perf_counter()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flex_block_mask(doc, static, device=a.device)  # warm the allocator off the graph
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        held = flex_block_mask(doc, static, device=a.device)
    capture_s = time.perf_counter() - t
    graph.replay()
    torch.cuda.synchronize()
    return {"capture_s": round(capture_s, 3), "equal_tiles_after_replay": same_tiles(held, ref),
            "replay_ms": timed_ms(graph.replay, a.device, a.iters)}


def target_arm(a, row) -> dict:
    doc = row.doc_ids.to(a.device)
    L = doc.shape[0]
    ours = document_block_mask(doc)
    mm = document_mask_mod(doc)
    ref, cold_s = compiled_reference(mm, None, L, L, a.device)
    return {"L": L, "equal_tiles": same_tiles(ours, ref),
            "intervals_ms": timed_ms(lambda: document_block_mask(doc), a.device, a.iters),
            "create_block_mask_compiled_ms": timed_ms(lambda: create_block_mask(
                mm, B=None, H=None, Q_LEN=L, KV_LEN=L, device=a.device, _compile=True),
                a.device, a.iters),
            "create_block_mask_first_s": cold_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    add_bucket_args(p)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    row, blocks = bucket(a)
    doc = {"command": "python3 -m bench.gpu.mask_build " + " ".join(argv or []),
           "torch": torch.__version__, "device": a.device, "seq": a.seq, "docs": a.docs,
           "anchors": a.anchors, "block": a.block,
           "drafter": drafter_arm(a, row, blocks), "target": target_arm(a, row)}
    print(doc)
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
