"""The warm-up: compile every (worker, shape bucket) once, through the compile gate.

The warmup stage compiles each drafter replica's whole step (forward, backward, optimizer) and
the target feature extractor's compiled parts (its decoder layers, flex attention on CUDA),
filling the compile cache; the train stage's warm start
runs the same callables again (cache hits) before the gate starts refusing recompiles. Each
bucket is run twice with different inputs, so any specialisation on the first call's objects
recompiles here, under the exclusive side, never as a refused recompile in steady state.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..models.masks import PackedRow, attention_backend
from ..models.features import FeatureExtractor, compile_backend
from ..models.target import load_target
from ..models.target_output import SoftLabels, TargetOutput, soft_positions
from ..runtime.gate import get_gate
from ..runtime.tracing import worker_thread_setup
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


def synthetic_output(rep: DrafterReplica, row: PackedRow, feat_width: int, feat_dtype,
                     seed: int = 0) -> TargetOutput:
    """Random target output of the right shapes for ``row``: features [1, L, feat_width] and,
    when the replica's objective distils, top-k soft labels at the row's response positions."""
    g = torch.Generator().manual_seed(seed + row.input_ids.shape[0])
    L, obj = row.input_ids.shape[0], rep.objective
    feats = torch.randn(1, L, feat_width, generator=g).to(rep.device, feat_dtype)
    if not obj.soft_labels:
        return TargetOutput(feats)
    pos = soft_positions(row.doc_ids, row.loss_mask)
    ids = torch.randint(0, rep.cfg.vocab_size, (pos.numel(), obj.top_k), generator=g,
                        dtype=torch.int32)
    lp = torch.log_softmax(torch.randn(pos.numel(), obj.top_k, generator=g), -1)
    return TargetOutput(feats, SoftLabels(pos, ids, lp).to(rep.device))


def warm_replica(rep: DrafterReplica, bucket_len: int, feat_width: int, feat_dtype,
                 optimizer_step: bool) -> dict:
    """Compile (through the gate) one replica's step for one bucket; returns timing.

    ``optimizer_step`` True runs the optimizer too (warmup stage: everything a step touches);
    training's warm start passes False so the weights stay exactly the initial/checkpoint ones.
    """
    gate = get_gate()
    row = synthetic_row(bucket_len, rep.cfg.vocab_size)
    blocks = rep.anchors(row, bucket_len)
    out = synthetic_output(rep, row, feat_width, feat_dtype)
    sig = rep.signature(bucket_len)
    t0 = time.perf_counter()
    gate.run(sig, lambda: rep.forward_backward(row, out, blocks))
    # A second call with fresh inputs: dynamo may specialise on the first call's objects (on
    # CUDA the BlockMask's mask_mod closure) and recompile once on the next; that must happen
    # here, under the exclusive side, not as a refused recompile in steady state.
    blocks2 = rep.anchors(row, bucket_len + 1)
    with gate.exclusive(f"settle:{sig!r}"):
        rep.forward_backward(row, TargetOutput(out.features.clone(), out.soft), blocks2)
    with gate.shared():
        if optimizer_step:
            rep.clip_and_step()
        else:
            rep.zero_grad()
    graph = {}
    if rep.graph_step:  # compile.cuda_graph_step: the whole step as one graph from here on
        with gate.exclusive(f"capture:{sig!r}"):  # its warm runs may compile
            graph = {"cuda_graph": rep.capture_step(row, out, blocks)}
    return _warm_record("drafter_step(fwd+bwd" + ("+optim" if optimizer_step else "") + ")",
                        rep.device, bucket_len, t0, replica=rep.index,
                        num_slots=rep.num_slots(bucket_len),
                        feature_shape=[1, bucket_len, feat_width], **graph)


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
    """One synthetic forward per (target device, bucket) through the gate before training: it
    compiles what the feature extractor compiles for the bucket (flex attention on CUDA, the
    decoder layers where ``target.compile`` is on; a cache hit after the warmup stage), so
    steady state never compiles."""
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


def warm_target_features(spec, bucket_lens: list[int], log=None) -> list[dict]:
    """Warmup stage, without loading the target's weights: on every target device where the
    feature extractor compiles something (flex attention on CUDA, the decoder layers where
    ``target.compile`` is on), run a ONE-layer copy of the target (random weights: a compiled
    graph depends on shapes, dtypes and code only) through :func:`warm_targets`, filling the
    compile cache that the train stage's warm start then hits. Nothing to do on an eager CPU
    target (SDPA, no compile)."""
    jobs, vocab = [], 8
    for dev in spec.topology.targets:
        attention = attention_backend(dev)
        if attention != "flex" and compile_backend(spec.target, dev, spec.compile.backend) is None:
            continue
        t = load_target(dataclasses.replace(spec.target, init="random"), dev, seed=spec.seed,
                        num_layers=1, need_tokenizer=False, attention=attention)
        t, vocab = dataclasses.replace(t, layer_ids=[0]), t.model.config.vocab_size
        fx = FeatureExtractor(t, compile=compile_backend(spec.target, dev, spec.compile.backend,
                                                         t.model))
        jobs.append((dev, lambda row, fx=fx, dev=dev: fx(row.input_ids.to(dev),
                                                         row.doc_ids.to(dev),
                                                         row.position_ids.to(dev))))
    return warm_targets(jobs, bucket_lens, vocab, log=log)
