"""Budgets before heavy work: GPU memory per device, the disk a run writes, a rough time per stage.

All from the spec and the model shapes (no weights loaded): ``dflash validate`` prints them, and
the env stage (the first stage) refuses a run whose disk budget does not fit the free space of
the results root. Rough by design: memory counts weights, optimizer state and the largest
activations; time is the FLOP model (:mod:`dflash.train.flops`) over a measured peak (the spec's
own last bench report, else the committed H200 measurement, else the CPU measured now) times an
assumed MFU (the report's measured one when there is one).

**Extension point**: ``DISK`` and ``MEMORY`` are lists of named items; a stage that writes (or
holds) something new appends one — e.g. a target-feature cache adds
``DISK.append(Item("feature cache", lambda s: ...))``. Each item maps a :class:`Sizes` to bytes
(DISK) or to {device: bytes} (MEMORY); the total, the printout and the disk refusal follow.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..errors import DFlashError
from ..models.drafter import DFlashConfig, head_dim_of
from ..models.target import hf_config, layer_ids
from ..runtime.resources import SHARE_AT_MOST
from ..spec.types import cache_mode, no_decoders_stage
from .cache_budget import cache_device, store_bytes
from .flops import linear_params, best_seconds_per_call, drafter_flops_per_step, target_flops

REPO = Path(__file__).resolve().parents[2]
# dense bf16 matmul FLOP/s measured on an H200 (bench stage, docs/benchmarks.md)
H200_PEAK_FILE = REPO / "bench/results/h200/qwen3-8b-2gpu/qwen3-8b-2gpu__bench__report.json"
ASSUMED_MFU = {"target": 0.5, "drafter": 0.2, "generate": 0.05}  # decode is memory-bound
STATE_BYTES = 12     # per drafter parameter in a checkpoint: fp32 weights + Adam m and v
TRAIN_BYTES = 16     # per drafter parameter in memory: the above + fp32 gradients
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class BudgetError(DFlashError):
    """The run's budget does not fit this machine (names what and by how much)."""


@dataclass(frozen=True)
class Sizes:
    """What the budget items are computed from (one spec, no weights)."""
    spec: object
    tcfg: object          # the target's transformers config
    dcfg: object          # the drafter's DFlashConfig
    target_params: int    # of the layers the target runs (features up to the deepest layer id)
    drafter_params: int   # trained parameters (the embedding and lm_head are the target's)
    samples: int
    sample_tokens: int    # upper bound per sample (prompt + new tokens)
    steps: int


@dataclass(frozen=True)
class Item:
    name: str
    estimate: Callable[[Sizes], object]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _params(cfg, layers: int, vocab: bool) -> int:
    return linear_params(cfg, layers) + (cfg.vocab_size * cfg.hidden_size if vocab else 0)


def sizes(spec) -> Sizes:
    tcfg = hf_config(spec.target)
    ids = layer_ids(spec.target, tcfg)
    dcfg = DFlashConfig.of_spec(spec)
    d, b, o = spec.data, spec.batching, spec.optim
    samples = d.max_prompts * d.samples_per_prompt
    sample_tokens = d.max_prompt_tokens + d.max_new_tokens
    per_step = max(1, b.token_budget // sample_tokens) * len(spec.topology.drafters) \
        * spec.topology.nodes
    steps = o.max_steps or -(-samples * (o.epochs or 1) // per_step)
    return Sizes(spec, tcfg, dcfg, _params(tcfg, max(ids) + 1, vocab=True),
                 _params(dcfg, dcfg.num_hidden_layers, vocab=False), samples, sample_tokens, steps)


# ---- disk: bytes each item writes under results/<spec>/ -------------------------------------
DISK: list[Item] = [
    Item("dataset", lambda s: s.samples * s.sample_tokens * 5),  # int32 ids + int8 loss mask
    Item("checkpoints", lambda s: (s.spec.checkpoint.keep + 1) * s.drafter_params * STATE_BYTES),
    Item("exported drafter", lambda s: s.drafter_params * 2),    # bf16 safetensors
]


# ---- memory: bytes per device ---------------------------------------------------------------
def _target_memory(s: Sizes) -> dict:
    t, b = s.spec.topology, s.spec.batching
    bytes_ = DTYPE_BYTES[s.spec.target.dtype]
    acts = b.token_budget * s.tcfg.hidden_size * bytes_ * (4 + s.tcfg.intermediate_size
                                                          // s.tcfg.hidden_size)
    feats = t.queue_depth * b.token_budget * s.dcfg.hidden_size * len(s.dcfg.target_layer_ids) \
        * bytes_
    return {dev: s.target_params * bytes_ + acts + feats for dev in t.targets}


def _drafter_memory(s: Sizes) -> dict:
    b, c = s.spec.batching, s.dcfg
    bytes_ = DTYPE_BYTES[s.spec.drafter.dtype]
    block_tokens = b.max_anchors * c.block_size
    acts = block_tokens * c.hidden_size * c.num_hidden_layers * 12 * bytes_
    logits = block_tokens * c.vocab_size * 4 // 8     # chunked cross-entropy: ~1/8 at a time
    head = 2 * c.vocab_size * c.hidden_size * bytes_  # the target's embedding and lm_head
    return {dev: s.drafter_params * TRAIN_BYTES + acts + logits + head
            for dev in s.spec.topology.drafters}


def _device_cache_memory(s: Sizes) -> dict:
    """``features.cache: device``: the whole store on the target's device (an upper bound:
    every sample at its spec's largest length; the train stage checks the dataset's own)."""
    if cache_mode(s.spec) != "device":
        return {}
    tokens = s.samples * s.sample_tokens
    return {cache_device(s.spec): store_bytes(s.spec, tokens, len(s.dcfg.target_layer_ids),
                                              s.dcfg.hidden_size)}


MEMORY: list[Item] = [Item("target", _target_memory), Item("drafter", _drafter_memory),
                      Item("feature cache", _device_cache_memory)]


def kv_cache_bytes(tcfg, rows: int, length: int, dtype_bytes: int) -> int:
    """A static KV cache of ``rows`` sequences of ``length`` positions over every layer."""
    return tcfg.num_hidden_layers * 2 * tcfg.num_key_value_heads * head_dim_of(tcfg) * rows \
        * length * dtype_bytes


def _generate_memory(s: Sizes) -> dict:
    """The data stage's fast engine on each target device (:class:`dflash.decode.engine.Engine`
    at ``data.gen_batch_size`` slots): the whole target, its static KV cache (a spare row; the
    longest sequence either phase writes: a prompt and its answer, or the writer's prefix and
    prompt), one prefill batch's activations and the decode step's fp32 logits."""
    t, d = s.tcfg, s.spec.data
    bytes_ = DTYPE_BYTES[s.spec.target.dtype]
    untied = not getattr(t, "tie_word_embeddings", True)
    weights = (_params(t, t.num_hidden_layers, vocab=True)
               + untied * t.vocab_size * t.hidden_size) * bytes_
    longest = max(s.sample_tokens, d.max_prompt_tokens + d.self_written.max_tokens)
    slots, S = d.gen_batch_size, -(-longest // 16) * 16
    kv = kv_cache_bytes(t, slots + 1, S, bytes_)
    prefill_rows = min(slots, max(16, min(slots // 16, 256)))
    acts = prefill_rows * S * t.hidden_size * bytes_ * (4 + t.intermediate_size // t.hidden_size)
    logits = slots * t.vocab_size * 4 * 2
    return {dev: int((weights + kv + acts + logits) * DATA_OVER_ESTIMATE)
            for dev in s.spec.topology.targets}


# the data stage's measured peak (reserved bytes) over the engine's items above: round 19 on one
# H200, 18.71 GB for 12.99 GB (1.44x: the whole steered stage, 60 chunks of prompts of varying
# length; round 18's 13.34 GB was a resumed stage's last 13 chunks)
# (bench/results/h200/round19-2026-12-05/lease/r/*__data__manifest.json#peak_device_memory)
DATA_OVER_ESTIMATE = 1.5

# the warm-up's measured peak (the caching allocator's reserved bytes: compile workspaces, the
# captured step's graph pool) over the training items' estimate: round 18 on one H200, 6.72 GB
# for 3.10 GB (smollm2-quality) and 9.56 GB for 4.29 GB (8 layers), both 2.2x
# (bench/results/h200/round18-2026-12-05/lease/r/*__warmup__manifest.json#peak_device_memory)
WARMUP_OVER_ESTIMATE = 2.3


# the bench's prompts are the eval sets' (MT-Bench first turns in the chat template: ~30-400
# tokens), not the data's: a bound for the decoders' caches
DECODE_PROMPT_TOKENS = 1024


def _decoders_memory(s: Sizes) -> dict:
    """The decoders stage (the bench's sweep compiled ahead) on the target's device, per process
    (each compiles its batch sizes one decoder at a time; the stage runs as many processes as
    fit in its share, :func:`dflash.stages.decoders.worker_count`), at the sweep's largest
    batch: the whole target and the drafter, each with a copy of its GEMM weights (the "fused"
    scope concatenates them), the target's and the drafter's static KV caches and a verify's
    fp32 logits; times :data:`WARMUP_OVER_ESTIMATE` (compile workspaces and the captured
    graphs' pool, as in the warm-up; the stage's manifest holds its processes' peaks summed,
    ``peak_device_memory``: round 27's one process 8.4 GB for this 7.6). {} for a spec without
    the stage."""
    t, c, b = s.tcfg, s.dcfg, s.spec.bench
    if no_decoders_stage(s.spec) is not None:
        return {}
    bytes_ = DTYPE_BYTES[s.spec.target.dtype]
    untied = not getattr(t, "tie_word_embeddings", True)
    weights = 2 * (_params(t, t.num_hidden_layers, vocab=True) + untied * t.vocab_size
                   * t.hidden_size) * bytes_ + 2 * s.drafter_params * DTYPE_BYTES[s.spec.drafter.dtype]
    rows = max(b.decode_batches) + 1
    S = -(-(DECODE_PROMPT_TOKENS + b.eval_max_new_tokens + c.block_size) // 16) * 16
    kv = kv_cache_bytes(t, rows, S, bytes_) \
        + c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * rows * S * bytes_
    logits = rows * c.block_size * t.vocab_size * 4
    return {s.spec.topology.targets[0]: int((weights + kv + logits) * WARMUP_OVER_ESTIMATE)}


def stage_memory(spec) -> dict[str, dict[str, int]]:
    """Estimated peak bytes per device of the GPU stages (what decides whether a warm-up or data
    stage may share its GPU: :func:`dflash.runtime.resources.units`): ``warmup`` loads the
    target and drafter and runs their steps (the training items but the feature cache, times
    :data:`WARMUP_OVER_ESTIMATE`, the measured ratio), ``data`` the generation engine (times
    :data:`DATA_OVER_ESTIMATE`), ``decoders`` the bench's decoders compiled ahead
    (:func:`_decoders_memory`), ``train`` every training item."""
    return _stage_memory(sizes(spec))


def _stage_memory(s: Sizes) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {"warmup": {}, "data": _generate_memory(s),
                                      "decoders": _decoders_memory(s), "train": {}}
    for item in MEMORY:
        for dev, n in item.estimate(s).items():
            out["train"][dev] = out["train"].get(dev, 0) + n
            if item.name != "feature cache":
                out["warmup"][dev] = out["warmup"].get(dev, 0) + int(n * WARMUP_OVER_ESTIMATE)
    return out


# ---- time -----------------------------------------------------------------------------------
def peak(spec, results: Path | None = None) -> tuple[float, str, dict]:
    """(FLOP/s per device, where it comes from, measured MFUs if any)."""
    own = results / spec.name / "bench" / "report.json" if results else None
    for path in filter(None, (own, H200_PEAK_FILE)):
        if path == H200_PEAK_FILE and spec.topology.drafters[0] == "cpu":
            break
        try:
            r = json.loads(path.read_text())
            mfu = {k: r[f"{k}_mfu"] for k in ("target", "drafter") if r.get(f"{k}_mfu")}
            where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            return float(r["peak"]["flops_per_s"]), str(where), mfu if path == own else {}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if spec.topology.drafters[0] != "cpu":
        return 0.0, "none (no bench report)", {}

    n = 1024  # a small matmul: a rough budget needs no more (the bench stage measures properly)
    a = torch.randn(n, n)
    return 2 * n ** 3 / best_seconds_per_call(lambda: a @ a, "cpu", reps=1, windows=5), \
        "measured now (CPU)", {}


def stage_seconds(s: Sizes, flops_per_s: float, mfu: dict) -> dict:
    if not flops_per_s:
        return {}
    m = {**ASSUMED_MFU, **mfu}
    t, b, d = s.spec.topology, s.spec.batching, s.spec.data
    gen_tokens = s.samples * d.max_new_tokens
    gen = 2 * s.target_params * gen_tokens / (flops_per_s * m["generate"] * len(t.targets))
    ids = s.dcfg.target_layer_ids
    docs = [s.sample_tokens] * max(1, b.token_budget // s.sample_tokens)
    tgt = target_flops(s.tcfg, max(ids) + 1, docs) / (flops_per_s * m["target"])
    dft = drafter_flops_per_step(s.dcfg, b.token_budget, b.max_anchors * s.dcfg.block_size,
                                 b.max_anchors * (s.dcfg.block_size - 1)) \
        / (flops_per_s * m["drafter"])
    per_step = max(tgt * len(t.drafters) / max(1, len(t.targets)), dft)
    evals = s.spec.bench.eval_prompts * len(s.spec.bench.eval_sets)
    bench = 2 * s.target_params * evals * s.spec.bench.eval_max_new_tokens * 3 \
        / (flops_per_s * m["generate"])
    return {"data": gen, "train": s.steps * per_step, "bench": bench}


def budget(spec, results: Path | None = None) -> dict:
    s = sizes(spec)
    flops_per_s, source, mfu = peak(spec, results)
    memory: dict[str, dict] = {}
    for item in MEMORY:
        for dev, n in item.estimate(s).items():
            memory.setdefault(dev, {})[item.name] = n
    disk = {item.name: item.estimate(s) for item in DISK}
    return {"memory": memory, "stages": _stage_memory(s),
            "disk": disk, "disk_total": sum(disk.values()),
            "seconds": stage_seconds(s, flops_per_s, mfu), "steps": s.steps,
            "peak_flops_per_s": flops_per_s, "peak_source": source,
            "mfu": {**ASSUMED_MFU, **mfu}, "warmup_compiles": spec.batching.num_buckets
            * len(spec.topology.drafters)}


def _dur(sec: float) -> str:
    return f"{sec:.0f} s" if sec < 120 else f"{sec / 60:.0f} min" if sec < 7200 \
        else f"{sec / 3600:.1f} h"


def render(b: dict) -> list[str]:
    lines = []
    for dev, items in b["memory"].items():
        lines.append(f"  memory {dev}: {_gb(sum(items.values()))} ("
                     + ", ".join(f"{k} {_gb(v)}" for k, v in items.items()) + ")")
    stages = b.get("stages", {})
    for dev, n in stages.get("data", {}).items():
        if not dev.startswith("cuda"):  # the fast engine's estimate; the GPU-sharing rule
            continue
        warm = stages["warmup"].get(dev, 0)
        dec = stages.get("decoders", {}).get(dev)
        also = f" and the decoders stage ({_gb(dec)})" if dec else ""
        lines.append(f"  memory {dev}, data stage: {_gb(n)} (the generation engine; beside the "
                     f"warm-up{also} on a GPU of >= "
                     f"{_gb(max(n, warm, dec or 0) / SHARE_AT_MOST)})")
    lines.append(f"  disk: {_gb(b['disk_total'])} ("
                 + ", ".join(f"{k} {_gb(v)}" for k, v in b["disk"].items()) + ")")
    if b["seconds"]:
        pk = b["peak_flops_per_s"]
        pk = f"{pk / 1e12:.1f} TFLOP/s" if pk >= 1e12 else f"{pk / 1e9:.0f} GFLOP/s"
        lines.append(f"  time (rough: FLOPs / peak {pk} "
                     f"[{b['peak_source']}] / MFU): warmup {b['warmup_compiles']} compile(s), "
                     + ", ".join(f"{k} ~{_dur(v)}" for k, v in b["seconds"].items())
                     + f" ({b['steps']} steps)")
    else:
        lines.append(f"  time: no peak for these devices yet ({b['peak_source']}); "
                     f"{b['steps']} train steps, {b['warmup_compiles']} warm-up compile(s)")
    return lines


def check_disk(spec, results: Path, b: dict | None = None) -> dict:
    """Refuse a run whose disk budget exceeds the free space where its results go."""
    b = b or budget(spec, results)
    where = results if results.exists() else next(
        (p for p in results.absolute().parents if p.exists()), Path("/"))
    done = sum(f.stat().st_size for f in (results / spec.name).rglob("*") if f.is_file()) \
        if (results / spec.name).is_dir() else 0
    free = shutil.disk_usage(where).free
    need = b["disk_total"] - done
    if need > free:
        raise BudgetError(f"{spec.path}: the run writes ~{_gb(b['disk_total'])} under "
                          f"{results / spec.name} (" + ", ".join(
                              f"{k} {_gb(v)}" for k, v in b["disk"].items())
                          + f"), {_gb(need)} more than is there now, but {where} has "
                          f"{_gb(free)} free; free space or lower checkpoint.keep / data sizes")
    return b
