"""Build the workers a spec describes: drafter replicas and target feature extractors.

Warmup and training both build through here, so they compile the same callables for the same
config, dtypes, feature width (N·H, never [.., N, H]) and shape buckets.
"""
from __future__ import annotations

import time

import torch

from .masks import PackedRow, sample_anchors
from .model import DFlashConfig, DFlashDrafter
from .packing import bucket_lengths
from .replica import DrafterReplica


def drafter_config(spec) -> DFlashConfig:
    from .target import hf_config, layer_ids

    tcfg = hf_config(spec["target"])
    d = spec["drafter"]
    return DFlashConfig.from_target_config(tcfg, d["num_layers"], d["block_size"],
                                           d["mask_token_id"], layer_ids(spec["target"], tcfg))


def buckets(spec) -> list[int]:
    b = spec["batching"]
    return bucket_lengths(b["token_budget"], b["num_buckets"])


def initial_state(cfg: DFlashConfig, seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in DFlashDrafter(cfg).state_dict().items()}


def make_replicas(spec, cfg: DFlashConfig, init_state: dict, total_steps: int
                  ) -> list[DrafterReplica]:
    from .target import target_embeddings

    embed, head = target_embeddings(spec["target"], spec["seed"])
    return [DrafterReplica(i, dev, cfg, spec, embed, head, init_state, total_steps)
            for i, dev in enumerate(spec["topology"]["drafters"])]


def make_target_workers(spec) -> list[tuple[str, object]]:
    """One frozen target copy per target device, truncated after the last feature layer."""
    from .target import FeatureExtractor, hf_config, layer_ids, load_target

    ids = layer_ids(spec["target"], hf_config(spec["target"]))
    workers = []
    for dev in spec["topology"]["targets"]:
        t = load_target(spec["target"], dev, seed=spec["seed"], need_lm_head=False,
                        num_layers=max(ids) + 1, need_tokenizer=False)
        fx = FeatureExtractor(t)
        workers.append((dev, lambda row, fx=fx, dev=dev: fx(row.input_ids.to(dev),
                                                             row.doc_ids.to(dev),
                                                             row.position_ids.to(dev))))
    return workers


def synthetic_row(bucket_len: int, vocab_size: int, seed: int = 0) -> PackedRow:
    """A full row of one document (prompt half, response half) for warming a bucket's shapes."""
    g = torch.Generator().manual_seed(seed + bucket_len)
    ids = torch.randint(5, vocab_size, (bucket_len,), generator=g)
    lm = torch.zeros(bucket_len, dtype=torch.bool)
    lm[bucket_len // 4:] = True
    return PackedRow(input_ids=ids, doc_ids=torch.zeros(bucket_len, dtype=torch.long),
                     position_ids=torch.arange(bucket_len), loss_mask=lm, sample_ids=[-1])


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
    if rep.device.startswith("cuda"):
        torch.cuda.synchronize(rep.device)
    return {"callable": "drafter_step(fwd+bwd" + ("+optim" if optimizer_step else "") + ")",
            "device": rep.device, "replica": rep.index, "bucket": bucket_len,
            "num_slots": rep.num_slots(bucket_len), "feature_shape": [1, bucket_len, feat_width],
            "seconds": round(time.perf_counter() - t0, 3)}


def warm_all(replicas: list[DrafterReplica], bucket_lens: list[int], feat_width: int, feat_dtype,
             optimizer_step: bool, log=None) -> list[dict]:
    """Warm every (replica, bucket), one replica at a time, each in a worker thread set up
    exactly like a training worker (dynamo settings are per thread in torch 2.13)."""
    import threading

    from .gate import worker_thread_setup
    from .scheduler import DYNAMO_SETTINGS

    records: list[dict] = []
    errors: list[BaseException] = []

    def work(rep):
        try:
            worker_thread_setup(**DYNAMO_SETTINGS)
            for L in bucket_lens:
                rec = warm_replica(rep, L, feat_width, feat_dtype, optimizer_step)
                records.append(rec)
                if log is not None:
                    log(rec)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    for rep in replicas:  # one device at a time: compiles never overlap, by construction
        t = threading.Thread(target=work, args=(rep,), name=f"warm-{rep.index}")
        t.start()
        t.join()
        if errors:
            raise errors[0]
    return records
