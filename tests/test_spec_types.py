"""The typed spec: frozen dataclasses whose fields are exactly the schema's properties (the schema
stays the one source of defaults, docs and errors), and the per-stage fingerprints they give."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from dflash.errors import SpecError
from dflash.spec.load import load_spec, schema, section_spec
from dflash.spec.types import SECTIONS, SelfWrittenSpec, SourceSpec, Spec

REPO = Path(__file__).resolve().parents[1]
SPEC_FILES = sorted((REPO / "specs").glob("*.yaml")) + [REPO / "tests" / "specs" / "micro.yaml"]


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_dataclass_fields_are_the_schema_properties():
    props = schema()["properties"]
    assert _names(Spec) - {"path"} == set(props)
    assert set(SECTIONS) == {k for k, v in props.items() if v.get("type") == "object"}
    for name, cls in SECTIONS.items():
        assert _names(cls) == set(props[name]["properties"]), name
    data = props["data"]["properties"]
    assert _names(SelfWrittenSpec) == set(data["self_written"]["properties"])
    assert _names(SourceSpec) == set(data["sources"]["items"]["properties"])


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.stem)
def test_every_spec_loads_typed_and_frozen(path):
    spec = load_spec(path)
    assert spec.name == path.stem and isinstance(spec.topology.drafters, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.optim.lr = 1.0
    # the validated dict round-trips, and the stage fingerprints are those of its content
    assert Spec.from_dict(spec.to_dict(), path) == spec
    assert {s: spec.fingerprint(s) for s in ("env", "warmup", "data", "train", "bench")} == \
        {s: load_spec(path).fingerprint(s) for s in ("env", "warmup", "data", "train", "bench")}


def test_fingerprints_follow_only_the_fields_a_stage_reads():
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    lr = spec.replace(optim={"lr": spec.optim.lr * 2})
    changed = {s for s in ("env", "warmup", "data", "train", "bench")
               if lr.fingerprint(s) != spec.fingerprint(s)}
    assert changed == {"train"}
    block = spec.replace(drafter={"block_size": 8})
    assert {s for s in ("env", "warmup", "data", "train", "bench")
            if block.fingerprint(s) != spec.fingerprint(s)} == {"warmup"}


def test_replace_validates_like_a_spec_file():
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    with pytest.raises(SpecError, match=r"field 'optim.lr'"):
        spec.replace(optim={"lr": -1})
    with pytest.raises(SpecError, match=r"unknown field 'optim.learning_rate'"):
        spec.replace(optim={"learning_rate": 1e-3})


def test_a_section_alone_gets_the_schema_defaults_and_errors():
    t = section_spec("target", {"model": "llama-micro", "init": "random"})
    assert (t.dtype, t.num_feature_layers, t.layer_ids) == ("float32", 5, None)
    with pytest.raises(SpecError, match=r"field 'target.init'"):
        section_spec("target", {"model": "llama-micro", "init": "zeros"})
    with pytest.raises(SpecError, match=r"did you mean 'dtype'"):
        section_spec("target", {"model": "llama-micro", "dtpye": "float32"})
