"""Load and validate ``specs/<name>.yaml``: JSON schema, did-you-mean, cross-field rules.

Every error names the spec file and the field path. Nothing heavy (torch, models) is loaded here
except for the optional device-presence check, which imports torch only to count GPUs. The typed
spec it returns (frozen dataclasses, the fields each stage depends on) is :mod:`dflash.spec.types`.
"""
from __future__ import annotations

import copy
import difflib
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ..errors import SpecError
from .inherit import attribute, resolve
from .types import Spec, build_section, cache_mode

SCHEMA_PATH = Path(__file__).with_name("schema") / "spec.schema.yaml"
DEVICE_RE = re.compile(r"^(cpu|cuda:(0|[1-9][0-9]{0,2}))$")


@lru_cache(maxsize=1)
def schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def absent_nulls(node: Any, sch: dict) -> Any:
    """Drop fields whose value is a null default: the same as absent (``data.source`` or
    ``data.sources`` is one of a pair that may not both be given)."""
    if not isinstance(node, dict) or sch.get("type") != "object":
        return node
    props = sch.get("properties", {})
    return {k: absent_nulls(v, props.get(k, {})) for k, v in node.items()
            if not (v is None and k in props and props[k].get("default", 0) is None)}


def section_spec(name: str, values: dict, file: str = "<spec>"):
    """One section from a partial dict, validated and with the schema's defaults: e.g.
    ``section_spec("target", {"model": "llama-micro", "init": "random"})`` for tools and tests
    that need a target without a whole spec."""
    sub = schema()["properties"][name]
    data = copy.deepcopy(values)
    errors = sorted(_Validator(sub).iter_errors(data), key=lambda e: len(e.absolute_path))
    if errors:
        raise _schema_error(file, errors[0], prefix=(name,))
    _fill_defaults(data, sub)
    return build_section(name, data)


def fmt_path(path) -> str:
    out = ""
    for p in path:  # list indices as [i], like the cross-field messages (topology.targets[0])
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "<top level>"


# "integer" means a real int: JSON schema would accept 1024.0 (and the arithmetic below would then
# fail on a float); bool is excluded as jsonschema already does.
_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, x: isinstance(x, int) and not isinstance(x, bool)))


def _non_finite(node: Any, path: tuple = ()):
    """Paths of NaN/inf values (YAML .nan/.inf pass every minimum/maximum check)."""
    if isinstance(node, float) and not math.isfinite(node):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _non_finite(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _non_finite(v, path + (i,))


def _fill_defaults(node: Any, sch: dict) -> None:
    """Fill JSON-schema defaults into ``node`` (recursively into objects)."""
    if not isinstance(node, dict) or sch.get("type") != "object":
        return
    for key, sub in sch.get("properties", {}).items():
        if key not in node and "default" in sub:
            node[key] = copy.deepcopy(sub["default"])
        if key in node:
            _fill_defaults(node[key], sub)


def _schema_error(file: str, err: jsonschema.ValidationError, prefix: tuple = ()) -> SpecError:
    at = prefix + tuple(err.absolute_path)
    where = fmt_path(at)
    if err.validator == "additionalProperties":
        allowed = list(err.schema.get("properties", {}))
        extra = sorted({str(k) for k in err.instance} - set(allowed))
        bad = extra[0] if extra else "?"
        field = f"{where}.{bad}" if at else bad
        hint = difflib.get_close_matches(bad, allowed, n=1)
        tip = f" — did you mean '{hint[0]}'?" if hint else f" (allowed: {', '.join(allowed)})"
        return SpecError(f"{file}: unknown field '{field}'{tip}")
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        field = f"{where}.{missing}" if at else missing
        return SpecError(f"{file}: missing required field '{field}'")
    alts = [r for sub in err.schema.get("oneOf", []) if isinstance(sub, dict)
            for r in sub.get("required", [])] if err.validator == "oneOf" else []
    if alts:  # e.g. data: source or sources
        names = " or ".join(f"'{where}.{a}'" for a in alts)
        return SpecError(f"{file}: field '{where}': give exactly one of {names}")
    return SpecError(f"{file}: field '{where}': {err.message}")


def parse_spec(data: Any, file: str = "<spec>") -> Spec:
    """Validate an already-parsed spec mapping; no device check (see :func:`check_devices`)."""
    if data is None:
        raise SpecError(f"{file}: the spec file is empty (expected a YAML mapping of fields)")
    if not isinstance(data, dict):
        raise SpecError(f"{file}: the spec must be a YAML mapping of fields, "
                        f"got {type(data).__name__}")
    data = copy.deepcopy(data)
    validator = _Validator(schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), e.path))
    if errors:
        raise _schema_error(file, errors[0])
    for where, value in _non_finite(data):
        raise SpecError(f"{file}: field '{fmt_path(where)}': {value} is not a finite number")
    _fill_defaults(data, schema())
    spec = Spec.from_dict(data, file)
    _check_cross_fields(spec, file)
    return spec


def load_spec(path: str | Path, check_devices_present: bool = False) -> Spec:
    """Read (with its ``base`` specs merged in, :mod:`dflash.spec.inherit`), validate and
    (optionally) check that the spec's devices exist on this machine."""
    path = Path(path)
    file = str(path)
    data, prov, bases = resolve(path)
    if bases:  # a null over a base's value with a null default: absent (data.source/sources)
        data = absent_nulls(data, schema())
    try:
        spec = parse_spec(data, file)
    except SpecError as e:
        raise attribute(e, file, prov, bases) from None
    if spec.name != path.stem:
        raise SpecError(f"{file}: field 'name': {spec.name!r} must equal the file stem "
                        f"{path.stem!r} (it names results/<name>/"
                        + ("; a spec with a base sets its own name)" if bases else ")"))
    if check_devices_present:
        check_devices(spec)
    return spec


def _check_cross_fields(spec: Spec, file: str) -> None:
    def fail(field: str, msg: str):
        raise SpecError(f"{file}: field '{field}': {msg}")

    b, d, t, o, data = spec.batching, spec.drafter, spec.target, spec.optim, spec.data
    # each anchor is a distinct position of the row, so more slots than tokens stay empty;
    # blocks are NOT bounded by the budget: the DFlash recipe's density (one anchor per 4-6
    # response tokens, block 16) needs max_anchors × block_size ≈ 3× token_budget
    if b.max_anchors > b.token_budget:
        fail("batching.max_anchors", f"{b.max_anchors} anchors exceed "
             f"batching.token_budget = {b.token_budget} (one anchor per row position at most)")
    if spec.loss.max_position is not None and spec.loss.max_position >= d.block_size:
        fail("loss.max_position", f"{spec.loss.max_position} is not a block position: "
             f"drafter.block_size = {d.block_size} has positions 1..{d.block_size - 1}")
    if b.max_batch_size > b.token_budget:
        fail("batching.max_batch_size", f"{b.max_batch_size} sequences cannot fit in "
             f"token_budget {b.token_budget}")
    smallest = b.token_budget >> (b.num_buckets - 1)
    if smallest < d.block_size * 2:
        fail("batching.num_buckets", f"{b.num_buckets} buckets make the smallest bucket "
             f"{smallest} tokens, shorter than two blocks ({2 * d.block_size})")
    if t.layer_ids is not None:
        if len(t.layer_ids) != t.num_feature_layers:
            fail("target.layer_ids", f"{len(t.layer_ids)} ids given but "
                 f"target.num_feature_layers = {t.num_feature_layers}")
        if len(set(t.layer_ids)) != len(t.layer_ids):
            fail("target.layer_ids", "ids must be distinct")
    if (o.epochs is None) == (o.max_steps is None):
        fail("optim", "give exactly one of 'epochs' or 'max_steps'")
    if data.max_prompt_tokens + data.max_new_tokens > b.token_budget:
        fail("data.max_new_tokens", f"max_prompt_tokens + max_new_tokens = "
             f"{data.max_prompt_tokens + data.max_new_tokens} exceeds "
             f"batching.token_budget = {b.token_budget}: a sequence would not fit a batch")
    if data.temperature == 0 and data.samples_per_prompt > 1 and data.source != "synthetic":
        # greedy decoding gives one answer a prompt: the samples would be the same sequence
        fail("data.samples_per_prompt", f"{data.samples_per_prompt} greedy answers "
             f"(data.temperature 0) of one prompt are one answer repeated; use 1, or a "
             f"temperature above 0")
    if data.source == "synthetic" and t.init != "random":
        fail("data.source", "'synthetic' (random responses) is only for throughput runs of "
             "random-weight targets (target.init: random); a pretrained target must be trained "
             "on its own generated answers")
    topo = spec.topology
    for role in ("targets", "drafters"):
        devices = getattr(topo, role)
        for i, dev in enumerate(devices):
            if not DEVICE_RE.match(dev):
                fail(f"topology.{role}[{i}]", f"{dev!r} is not a device name "
                     f"(use 'cpu' or 'cuda:N')")
        gpus = [x for x in devices if x != "cpu"]
        dup = sorted({x for x in gpus if gpus.count(x) > 1})
        if dup:
            fail(f"topology.{role}", f"{', '.join(dup)} listed twice; one worker per GPU")
    shared = sorted(set(topo.targets) & set(topo.drafters) - {"cpu"})
    if shared and not topo.allow_shared_devices:
        fail("topology", f"{', '.join(shared)} is both a target and a drafter device; set "
             f"topology.allow_shared_devices: true if you mean it")
    if topo.rendezvous != "auto":
        port = int(topo.rendezvous.rsplit(":", 1)[1])
        if not 1 <= port <= 65535:
            fail("topology.rendezvous", f"port {port} is out of range (1-65535)")
        if topo.nodes == 1:
            fail("topology.rendezvous", "a rendezvous is only used with topology.nodes > 1")
    if cache_mode(spec) == "device" and len(topo.targets) != 1:
        fail("features.cache", f"features.cache device keeps the store on the one target "
             f"worker's device, which writes and reads it in its own stream order; this spec has "
             f"{len(topo.targets)} target workers (topology.targets): use host or disk")
    if cache_mode(spec) != "off" and topo.nodes > 1:
        fail("features.cache", f"a feature cache needs topology.nodes 1 (each node would cache "
             f"only its own share of epoch 0, and an epoch >= 1 row is served only when every "
             f"sample in it is cached); this spec has {topo.nodes} nodes")
    graph = {True: "on", False: "off"}.get(spec.compile.cuda_graph_step,
                                           spec.compile.cuda_graph_step)
    if graph == "on" and (len(topo.drafters) != 1 or topo.nodes != 1):
        fail("compile.cuda_graph_step", f"'on' needs one drafter device and topology.nodes 1 "
             f"(this spec: {len(topo.drafters)} drafter device(s), {topo.nodes} node(s)); use "
             f"auto to capture only where it applies")
    if spec.env.lock.startswith("/") or ".." in Path(spec.env.lock).parts:
        fail("env.lock", "must be a path inside the repository (e.g. envs/cpu-py311.lock)")


def live_devices() -> list[str]:
    import torch  # only here: the schema checks above must not need torch

    return ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def check_devices(spec: Spec, found: list[str] | None = None) -> None:
    """Fail in seconds, naming the spec, the devices asked for and the devices found."""
    found = live_devices() if found is None else found
    missing = [d for d in dict.fromkeys(spec.devices()) if d not in found]
    if missing:
        raise SpecError(f"{spec.path}: field 'topology': spec '{spec.name}' asks for devices "
                        f"{', '.join(dict.fromkeys(spec.devices()))}; missing here: "
                        f"{', '.join(missing)}; this machine has: {', '.join(found)}")
