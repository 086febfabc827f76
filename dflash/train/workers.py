"""Build the workers a spec describes: drafter replicas and target feature extractors.

Warmup and training both build through here, so they compile the same callables for the same
config, dtypes, feature width (N·H, never [.., N, H]) and shape buckets.
"""
from __future__ import annotations

import torch

from ..models.drafter import DFlashConfig, DFlashDrafter
from .packing import bucket_lengths
from .replica import DrafterReplica


def drafter_config(spec) -> DFlashConfig:
    from ..models.target import hf_config, layer_ids

    tcfg = hf_config(spec.target)
    d = spec.drafter
    return DFlashConfig.from_target_config(tcfg, d.num_layers, d.block_size,
                                           d.mask_token_id, layer_ids(spec.target, tcfg))


def buckets(spec) -> list[int]:
    b = spec.batching
    return bucket_lengths(b.token_budget, b.num_buckets)


def initial_state(cfg: DFlashConfig, seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in DFlashDrafter(cfg).state_dict().items()}


def make_replicas(spec, cfg: DFlashConfig, init_state: dict, total_steps: int
                  ) -> list[DrafterReplica]:
    from ..models.target import target_embeddings

    embed, head = target_embeddings(spec.target, spec.seed)
    return [DrafterReplica(i, dev, cfg, spec, embed, head, init_state, total_steps)
            for i, dev in enumerate(spec.topology.drafters)]


def make_target_workers(spec) -> list[tuple[str, object]]:
    """One frozen target copy per target device, truncated after the last feature layer, its
    decoder layers compiled where ``target.compile`` resolves to a backend."""
    from ..models.masks import attention_backend
    from ..models.target import FeatureExtractor, compile_backend, hf_config, layer_ids, load_target

    ids = layer_ids(spec.target, hf_config(spec.target))
    workers = []
    for dev in spec.topology.targets:
        t = load_target(spec.target, dev, seed=spec.seed, num_layers=max(ids) + 1,
                        need_tokenizer=False, attention=attention_backend(dev))
        fx = FeatureExtractor(t, compile=compile_backend(spec.target, dev, spec.compile.backend,
                                                         t.model))
        if captured(spec, dev, fx):
            from ..models.target_graph import CapturedFeatures

            cap = CapturedFeatures(fx, dev)  # takes the row's host tensors: one copy in
            workers.append((dev, lambda row, cap=cap: cap(row.input_ids, row.doc_ids,
                                                          row.position_ids)))
            continue
        workers.append((dev, lambda row, fx=fx, dev=dev: fx(row.input_ids.to(dev),
                                                             row.doc_ids.to(dev),
                                                             row.position_ids.to(dev))))
    return workers


def captured(spec, device: str, fx) -> bool:
    """``target.cuda_graph``: auto captures a compiled extractor on a CUDA device."""
    mode = {False: "off"}.get(spec.target.cuda_graph, spec.target.cuda_graph)
    return mode == "auto" and device.startswith("cuda") and bool(fx.compile)
