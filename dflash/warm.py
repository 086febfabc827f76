"""The warm-up: compile every (worker, shape bucket) once, through the compile gate.

The warmup stage compiles each drafter replica's whole step (forward, backward, optimizer) and,
on CUDA, the target's flex attention, filling the compile cache; the train stage's warm start
runs the same callables again (cache hits) before the gate starts refusing recompiles. Each
bucket is run twice with different inputs, so any specialisation on the first call's objects
recompiles here, under the exclusive side, never as a refused recompile in steady state.
"""
from __future__ import annotations

import time

import torch

from .masks import PackedRow, sample_anchors
from .model import head_dim_of
from .replica import DrafterReplica


def synthetic_row(bucket_len: int, vocab_size: int, seed: int = 0, docs: int = 1) -> PackedRow:
    """A full row of ``docs`` equal documents (first quarter prompt, rest response) for warming
    a bucket's shapes."""
    g = torch.Generator().manual_seed(seed + bucket_len)
    ids = torch.randint(5, vocab_size, (bucket_len,), generator=g)
    lm = torch.zeros(bucket_len, dtype=torch.bool)
    lm[bucket_len // 4:] = True
    doc = torch.arange(bucket_len) * docs // bucket_len
    starts = torch.searchsorted(doc, doc, right=False)  # first index of each token's document
    return PackedRow(input_ids=ids, doc_ids=doc, position_ids=torch.arange(bucket_len) - starts,
                     loss_mask=lm, sample_ids=[-1])


def warm_replica(rep: DrafterReplica, bucket_len: int, feat_width: int, feat_dtype,
                 optimizer_step: bool) -> dict:
    """Compile (through the gate) one replica's step for one bucket; returns timing.

    ``optimizer_step`` True runs the optimizer too (warmup stage: everything a step touches);
    training's warm start passes False so the weights stay exactly the initial/checkpoint ones.
    """
    from .gate import get_gate

    gate = get_gate()
    row = synthetic_row(bucket_len, rep.cfg.vocab_size)
    blocks = sample_anchors(row, rep.num_slots(bucket_len), rep.block_size,
                            torch.Generator().manual_seed(bucket_len), rep.cfg.mask_token_id)
    feats = torch.randn(1, bucket_len, feat_width, dtype=feat_dtype, device=rep.device)
    sig = rep.signature(bucket_len)
    t0 = time.perf_counter()
    gate.run(sig, lambda: rep.forward_backward(row, feats, blocks))
    # A second call with fresh inputs: dynamo may specialise on the first call's objects (on
    # CUDA the BlockMask's mask_mod closure) and recompile once on the next; that must happen
    # here, under the exclusive side, not as a refused recompile in steady state.
    blocks2 = sample_anchors(row, rep.num_slots(bucket_len), rep.block_size,
                             torch.Generator().manual_seed(bucket_len + 1), rep.cfg.mask_token_id)
    with gate.exclusive(f"settle:{sig!r}"):
        rep.forward_backward(row, feats.clone(), blocks2)
    with gate.shared():
        if optimizer_step:
            rep.clip_and_step()
        else:
            rep.zero_grad()
    return _warm_record("drafter_step(fwd+bwd" + ("+optim" if optimizer_step else "") + ")",
                        rep.device, bucket_len, t0, replica=rep.index,
                        num_slots=rep.num_slots(bucket_len),
                        feature_shape=[1, bucket_len, feat_width])


def _warm_record(name: str, dev: str, bucket: int, t0: float, **extra) -> dict:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)  # the seconds include the device work
    return {"callable": name, "device": dev, **extra, "bucket": bucket,
            "seconds": round(time.perf_counter() - t0, 3)}


def _warm_in_threads(jobs: list, work, log=None) -> list[dict]:
    """Run the generator ``work(job)`` for each job, one job at a time (compiles never overlap,
    by construction), in a worker thread set up exactly like a training worker (dynamo settings
    are per thread in torch 2.13); collect and log the records it yields; its error re-raises
    here."""
    from concurrent.futures import ThreadPoolExecutor

    from .gate import worker_thread_setup

    def collect(job) -> list[dict]:
        records = []
        for rec in work(job):
            records.append(rec)
            if log is not None:
                log(rec)
        return records

    records: list[dict] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="warm",
                            initializer=worker_thread_setup) as pool:
        for job in jobs:  # the next job starts only after this one finished without error
            records += pool.submit(collect, job).result()
    return records


def warm_all(replicas: list[DrafterReplica], bucket_lens: list[int], feat_width: int, feat_dtype,
             optimizer_step: bool, log=None) -> list[dict]:
    """Warm every (replica, bucket) in worker threads, one replica at a time."""
    return _warm_in_threads(replicas, lambda rep: (
        warm_replica(rep, L, feat_width, feat_dtype, optimizer_step) for L in bucket_lens), log)


def warm_targets(targets: list[tuple[str, object]], bucket_lens: list[int], vocab_size: int,
                 log=None) -> list[dict]:
    """One synthetic forward per (target device, bucket) through the gate before training: on
    CUDA it compiles the target's flex attention for the bucket (a cache hit after the warmup
    stage), so steady state never compiles."""
    from .gate import get_gate

    gate = get_gate()

    def work(job):
        dev, fn = job
        for L in bucket_lens:
            row = synthetic_row(L, vocab_size)
            t0 = time.perf_counter()
            gate.run(("target_forward", dev, L), lambda: fn(row))
            # a second, different document layout settles any specialisation on the first
            # call's mask objects here, under exclusive, not as a refused recompile later
            with gate.exclusive(f"settle:target_forward:{dev}:{L}"):
                fn(synthetic_row(L, vocab_size, seed=1, docs=3))
            yield _warm_record("target_forward", dev, L, t0)

    return _warm_in_threads(targets, work, log)


def warm_target_attention(spec, bucket_lens: list[int], log=None) -> list[dict]:
    """Warmup stage, without loading target weights: compile the target's flex attention for
    every (target device, bucket) on q/k/v of the target's shapes, dtype and layout, filling the
    compile cache that the train stage's :func:`warm_targets` then hits. No-op on CPU (SDPA)."""
    from .gate import get_gate
    from .masks import attention_backend, compiled_flex_attention, document_block_mask
    from .spec import dtype_of
    from .target import hf_config

    tcfg = hf_config(spec.target)
    hq, hkv = tcfg.num_attention_heads, tcfg.num_key_value_heads
    hd = head_dim_of(tcfg)
    dtype = dtype_of(spec.target.dtype)
    gate = get_gate()
    devices = [d for d in spec.topology.targets if attention_backend(d) == "flex"]

    def work(dev):
        for L in bucket_lens:
            # [B, L, heads, D] transposed to [B, heads, L, D]: the layout HF attention passes
            q, k, v = (torch.randn(1, L, h, hd, device=dev, dtype=dtype).transpose(1, 2)
                       for h in (hq, hkv, hkv))
            t0 = time.perf_counter()
            for docs in (1, 3):  # two layouts: the second settles any specialisation
                mask = document_block_mask(synthetic_row(L, 8, docs=docs).doc_ids.to(dev))
                gate.run(("target_attention", dev, L), lambda: compiled_flex_attention()(
                    q, k, v, block_mask=mask, scale=hd ** -0.5, enable_gqa=hq != hkv))
            yield _warm_record("target_flex_attention", dev, L, t0)

    return _warm_in_threads(devices, work, log)
