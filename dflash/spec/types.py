"""The typed spec: frozen dataclasses built from a validated spec dict (:func:`dflash.spec.load.parse_spec`
builds them), one per section, and which fields each stage's output depends on (:func:`stage_fields`).

Field names mirror the schema's properties exactly (``tests/test_spec_types.py`` holds them
together); defaults, docs and error messages live in the schema only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ..artifacts.manifest import fingerprint


# ---------------------------------------------------------------------------------------------
# the typed spec: frozen dataclasses built from the validated dict. Field names mirror the
# schema's properties exactly (a test holds them together); defaults, docs and error messages
# live in the schema only.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TargetSpec:
    model: str
    init: str
    dtype: str
    num_feature_layers: int
    layer_ids: tuple[int, ...] | None
    compile: str
    # a default, unlike the other fields: code that builds a TargetSpec by hand (tests, tools)
    # predates the field; the schema's default is the same
    cuda_graph: str = "auto"


@dataclass(frozen=True)
class DrafterSpec:
    num_layers: int
    block_size: int
    mask_token_id: int
    dtype: str
    # a default: code that builds a DrafterSpec by hand predates the field (schema: the same)
    init: str = "random"


@dataclass(frozen=True)
class BatchingSpec:
    token_budget: int
    max_batch_size: int
    max_anchors: int
    num_buckets: int


@dataclass(frozen=True)
class LossSpec:
    gamma: float
    kind: str
    max_position: int | None
    kd_top_k: int


@dataclass(frozen=True)
class TopologySpec:
    targets: tuple[str, ...]
    drafters: tuple[str, ...]
    allow_shared_devices: bool
    queue_depth: int
    nodes: int
    rendezvous: str


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``data.sources``: count, or weight (a share of the rest), or neither."""
    source: str
    count: int | None = None
    weight: float | None = None


@dataclass(frozen=True)
class SelfWrittenSpec:
    temperature: float
    max_tokens: int
    min_chars: int
    max_chars: int
    oversample: float
    max_rounds: int
    # MT-Bench-style categories whose cues steer the writer (dflash/data/self_written.py);
    # empty: unsteered, and the data fingerprint as it was before the field existed
    categories: tuple[str, ...] = ()


@dataclass(frozen=True)
class DataSpec:
    source: str | None
    sources: tuple[SourceSpec, ...] | None
    self_written: SelfWrittenSpec
    decontaminate_ngram: int
    max_prompts: int
    samples_per_prompt: int
    max_prompt_tokens: int
    max_new_tokens: int
    temperature: float
    gen_batch_size: int
    engine: str
    max_bad_fraction: float


@dataclass(frozen=True)
class OptimSpec:
    lr: float
    warmup_ratio: float
    epochs: int | None
    max_steps: int | None
    grad_clip: float
    weight_decay: float
    beta2: float
    min_lr_ratio: float = 0.0


@dataclass(frozen=True)
class CheckpointSpec:
    every_steps: int
    keep: int


@dataclass(frozen=True)
class MonitorSpec:
    tau_every_steps: int | None
    tau_prompts: int
    tau_max_new_tokens: int
    tensorboard: bool
    profile_steps: int = 0
    profile_start: int = 3  # the global step the profile window opens at (dflash.train.profile)
    stall_s: float | None = 300.0  # no step for this long fails the run (dflash.train.stall)


@dataclass(frozen=True)
class FeaturesSpec:
    cache: str
    dtype: str
    headroom: float


@dataclass(frozen=True)
class CompileSpec:
    backend: str
    head_loss: str
    cuda_graph_step: str
    head_chunk: int = 2048


@dataclass(frozen=True)
class BenchSpec:
    mode: str
    steps: int
    warmup_steps: int
    eval_sets: tuple[str, ...]
    eval_prompts: int
    eval_max_new_tokens: int
    real_prompts: int
    eval_batch_size: int
    protocols: tuple[str, ...] = ("dflash",)
    reference_max_new_tokens: int = 2048
    decode_batches: tuple[int, ...] = (1, 4, 16, 64)
    decode_widths: tuple[int, ...] = (4, 8, 16)  # verify widths of the decode sweep
    decode_shapes: str = "static"  # the sweep's compiled regions: a graph per shape, or symbolic


@dataclass(frozen=True)
class EnvSpec:
    lock: str
    mode: str
    wheel_dir: str | None


SECTIONS: dict[str, type] = {
    "target": TargetSpec, "drafter": DrafterSpec, "batching": BatchingSpec, "loss": LossSpec,
    "topology": TopologySpec, "data": DataSpec, "optim": OptimSpec,
    "checkpoint": CheckpointSpec, "monitor": MonitorSpec, "features": FeaturesSpec,
    "compile": CompileSpec,
    "bench": BenchSpec, "env": EnvSpec,
}


# sections' fields that are objects themselves: field -> dataclass (a list: a tuple of them)
NESTED: dict[type, dict[str, type]] = {
    DataSpec: {"self_written": SelfWrittenSpec, "sources": SourceSpec},
}


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _build(cls: type, values: dict):
    nested = NESTED.get(cls, {})

    def field_value(k: str, v: Any) -> Any:
        if k not in nested or v is None:
            return _frozen(v)
        if isinstance(v, (list, tuple)):
            return tuple(_build(nested[k], x) for x in v)
        return _build(nested[k], v)

    return cls(**{k: field_value(k, v) for k, v in values.items()})


def build_section(name: str, values: dict):
    return _build(SECTIONS[name], values)


def _plain(value: Any) -> Any:
    """A section (or field) as the validated dict held it: a source entry without the count or
    weight it did not give."""
    if isinstance(value, SourceSpec):
        return {k: v for k, v in asdict(value).items() if v is not None}
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


@dataclass(frozen=True)
class Spec:
    """A validated spec with defaults filled in. ``path`` is the file it came from."""

    name: str
    seed: int
    target: TargetSpec
    drafter: DrafterSpec
    batching: BatchingSpec
    loss: LossSpec
    topology: TopologySpec
    data: DataSpec
    optim: OptimSpec
    checkpoint: CheckpointSpec
    monitor: MonitorSpec
    features: FeaturesSpec
    compile: CompileSpec
    bench: BenchSpec
    env: EnvSpec
    path: Path = field(default=Path("<spec>"), compare=False)

    @classmethod
    def from_dict(cls, data: dict, path: str | Path = "<spec>") -> "Spec":
        """From a validated dict with every default filled in (see :func:`parse_spec`)."""
        return cls(name=data["name"], seed=data["seed"], path=Path(path),
                   **{k: build_section(k, data[k]) for k in SECTIONS})

    def to_dict(self) -> dict:
        """The validated dict again (JSON-able; lists as tuples)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "path"}

    def replace(self, **sections: dict) -> "Spec":
        """A copy with some fields of some sections changed, validated again like a spec file:
        ``spec.replace(topology={"targets": ["cpu"]})``."""
        data = self.to_dict()
        for name, values in sections.items():
            if isinstance(values, dict):
                data[name] = {**data[name], **values}
            else:
                data[name] = values
        from .load import absent_nulls, parse_spec, schema  # a cycle: the loader builds a Spec

        return parse_spec(absent_nulls(_thawed(data), schema()), str(self.path))

    def section(self, stage: str) -> dict:
        """The spec fields a stage's output depends on, as {field path: value}. Snakemake turns
        them into rule params, so changing optim.lr reruns train+bench only, and changing
        drafter.block_size reruns warmup too."""
        return {k: _plain(v) for k, v in stage_fields(self)[stage].items()}

    def fingerprint(self, stage: str) -> str:
        return fingerprint(self.section(stage))

    def devices(self) -> list[str]:
        """One node's devices (every node of a multi-node run uses the same names)."""
        return list(self.topology.targets) + list(self.topology.drafters)

    def machine_devices(self) -> list[str]:
        """The devices of this machine the stages use when every node runs here (simulated
        nodes, dflash.runtime.launch): node i's cuda:j is cuda:(i·k + j), k = GPUs per node."""
        devs = self.devices()
        ids = [int(d.split(":")[1]) for d in devs if d.startswith("cuda:")]
        if self.topology.nodes == 1 or not ids:
            return devs
        k = max(ids) + 1
        return ["cpu"] * devs.count("cpu") + [f"cuda:{i}" for i in range(self.topology.nodes * k)]


def stage_fields(spec: Spec) -> dict[str, dict[str, Any]]:
    """Which spec fields each stage's output depends on."""
    t = spec.target
    target_identity = {"target.model": t.model, "target.init": t.init, "target.dtype": t.dtype}
    return {
        "env": {"env": spec.env},
        # everything that changes a compiled shape or the compiled code
        "warmup": {**target_identity, "target.num_feature_layers": t.num_feature_layers,
                   "target.layer_ids": t.layer_ids, "target.compile": t.compile,
                   "drafter": _shape_only(spec.drafter),
                   "batching": spec.batching, "topology.drafters": spec.topology.drafters,
                   "compile": _compile_identity(spec.compile), "seed": spec.seed,
                   **_loss_shape(spec.loss)},
        "data": {**target_identity, "data": _data_identity(spec.data), "seed": spec.seed},
        # features, when a cache is on: a cached epoch >= 1 row holds its samples' epoch-0
        # features (float8 storage rounds them), so the weights depend on it; off leaves the
        # fingerprint as it was before the field existed
        # optim.min_lr_ratio 0 (the cosine to 0) as before the field existed
        "train": {"loss": spec.loss, "optim": _as_before(spec.optim, min_lr_ratio=0.0),
                  "checkpoint": spec.checkpoint,
                  "topology": spec.topology, "monitor": _monitor_identity(spec.monitor),
                  "seed": spec.seed,
                  **({"features": spec.features} if cache_mode(spec) != "off" else {}),
                  # the starting weights, not a shape: a random start leaves the fingerprint
                  # as it was before the field existed
                  **({"drafter.init": spec.drafter.init} if spec.drafter.init != "random"
                     else {})},
        # the bench's decoders compiled ahead: their shapes (the target, the drafter, the
        # primary eval set's prompts, the sweep's batch sizes and widths), not the weights
        "decoders": {**target_identity, "target.num_feature_layers": t.num_feature_layers,
                     "target.layer_ids": t.layer_ids, "drafter": _shape_only(spec.drafter),
                     "topology.targets": spec.topology.targets, "seed": spec.seed,
                     **{f"bench.{k}": v for k, v in _decoders_bench(spec.bench).items()}},
        "bench": {"bench": spec.bench},
    }


# eval sets whose prompts are read from the data stage's output (its training prompts; the
# held-out prompts are those the data did not use)
EVAL_SETS_FROM_DATA = ("heldout", "train")


def _decoders_bench(b: BenchSpec) -> dict:
    """The bench fields its decoding sweep's decoders are built from."""
    return {"primary_set": b.eval_sets[0] if b.eval_sets else None,
            "eval_prompts": b.eval_prompts, "eval_max_new_tokens": b.eval_max_new_tokens,
            "real_prompts": b.real_prompts, "decode_batches": b.decode_batches,
            "decode_widths": b.decode_widths, "decode_shapes": b.decode_shapes}


def no_decoders_stage(spec: Spec) -> str | None:
    """Why a spec's DAG has no decoders stage (None: it has one, and its bench waits for it).
    The stage compiles the bench's decoding sweep ahead, so it exists where the sweep compiles
    (a CUDA target, ``bench.decode_batches`` not empty, a pretrained target: a random one has
    no τ to bench) and where the sweep's prompts, the first of ``bench.eval_sets``, are known
    before the data stage has run."""
    b = spec.bench
    if not str(spec.topology.targets[0]).startswith("cuda"):
        return f"the target runs on {spec.topology.targets[0]}: the bench decodes eagerly there"
    if not b.decode_batches:
        return "bench.decode_batches is []: no decoding sweep"
    if spec.target.init == "random" or b.eval_prompts == 0 or not b.eval_sets:
        return "no τ evaluation (a random target, bench.eval_prompts 0 or no bench.eval_sets)"
    if b.eval_sets[0] in EVAL_SETS_FROM_DATA:
        return (f"bench.eval_sets[0] is {b.eval_sets[0]!r}: its prompts come from the data "
                f"stage's output")
    return None


def _as_before(section, **before) -> dict:
    """``section`` as its fingerprint sees it: each field named in ``before`` (added after the
    section's first runs) left out where it holds the value, or one of the values (a tuple),
    that runs the section as it was before the field existed."""
    plain = _plain(section)
    for name, values in before.items():
        if getattr(section, name) in (values if isinstance(values, tuple) else (values,)):
            del plain[name]
    return plain


def _compile_identity(c: CompileSpec) -> dict:
    """The compile section as its fingerprint sees it: ``cuda_graph_step`` off leaves it as it
    was before the field existed (the default, auto, captures on CUDA: a new warm-up), and so
    does ``head_chunk`` at its default (2048)."""
    return _as_before(c, cuda_graph_step=("off", False), head_chunk=2048)


def _monitor_identity(m: MonitorSpec) -> dict:
    """The monitor section as the train fingerprint sees it: ``profile_steps`` 0 (off) leaves
    it as it was before the field existed, and so does ``profile_start`` when the profile is
    off or the window opens where it did before the field existed (step 3); ``stall_s`` is
    never in it."""
    plain = _plain(m)
    del plain["stall_s"]  # when a hang is declared changes nothing a run computes
    if not m.profile_steps:
        del plain["profile_steps"]
    if not m.profile_steps or m.profile_start == MonitorSpec.profile_start:
        del plain["profile_start"]
    return plain


def _data_identity(data: DataSpec) -> dict:
    """The data section as its fingerprint sees it: unsteered self-written prompts (no
    ``data.self_written.categories``) leave it as it was before the field existed."""
    plain = _plain(data)
    if not data.self_written.categories:
        plain["self_written"] = {k: v for k, v in plain["self_written"].items()
                                 if k != "categories"}
    return plain


def _loss_shape(loss: LossSpec) -> dict:
    """The loss fields the compiled drafter step's shapes and code depend on: ``max_position``
    (the head and loss run on K = max_position rows per block) and ``kind`` (soft labels add
    inputs; ``kd_top_k`` sizes them). Without them a cap-8 or KD arm shared the base's warm-up
    entry, which had compiled the base's step, and compiled its own in the train stage's warm
    start instead. The defaults (ce, every position) add nothing: the fingerprint stays as it
    was before these were counted. γ is a device tensor input, not a shape: not counted."""
    out: dict = {}
    if loss.max_position is not None:
        out["loss.max_position"] = loss.max_position
    if loss.kind != "ce":
        out.update({"loss.kind": loss.kind, "loss.kd_top_k": loss.kd_top_k})
    return out


def _shape_only(drafter: DrafterSpec) -> dict:
    """The drafter fields warm-up compiles for: all but ``init`` (the starting weights change
    no compiled shape, so an init arm shares the base's warm-up)."""
    return {k: v for k, v in _plain(drafter).items() if k != "init"}


def cache_mode(spec: Spec) -> str:
    """``features.cache`` as off, device, host or disk (YAML 1.1 reads a bare ``off`` as
    False)."""
    return "off" if spec.features.cache in ("off", False) else spec.features.cache


def _thawed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thawed(v) for v in value]
    return value
