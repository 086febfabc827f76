"""Spec inheritance (dflash.spec.inherit), sweep files (dflash.spec.sweeps) and the shared-stage store's
hard links (dflash.artifacts.sharing), without running a stage: seconds in all."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.errors import SpecError, StaleArtifact
from dflash.runtime.harness import REPO
from dflash.artifacts.sharing import link_stage, share_key
from dflash.spec.load import load_spec
from dflash.spec.sweeps import load_sweep, load_sweeps, materialise
from dflash.spec.types import no_decoders_stage

MICRO = REPO / "tests" / "specs" / "micro.yaml"


@pytest.fixture
def specs(tmp_path) -> Path:
    d = tmp_path / "specs"
    d.mkdir()
    (d / "micro.yaml").write_text(MICRO.read_text())
    return d


def _write(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


def test_child_spec_is_the_base_deep_merged(specs):
    child = _write(specs / "child.yaml", {"base": "micro", "name": "child",
                                         "loss": {"gamma": 2.5}, "optim": {"lr": 3e-4}})
    base, spec = load_spec(specs / "micro.yaml"), load_spec(child)
    assert spec.name == "child" and spec.loss.gamma == 2.5 and spec.optim.lr == 3e-4
    # everything else is the base's, siblings of an overridden key included (deep merge)
    assert spec.optim.max_steps == base.optim.max_steps == 6
    assert spec.to_dict() | {"name": "micro", "loss": base.to_dict()["loss"],
                             "optim": base.to_dict()["optim"]} == base.to_dict()
    # same data and shape fields: the child shares the base's data and warm-up stages
    for st in ("env", "warmup", "data"):
        assert spec.fingerprint(st) == base.fingerprint(st), st
    assert spec.fingerprint("train") != base.fingerprint("train")


def test_chained_bases_and_a_null_that_swaps_a_pair(specs):
    _write(specs / "mid.yaml", {"base": "micro.yaml", "name": "mid", "drafter": {"block_size": 8}})
    leaf = _write(specs / "leaf.yaml", {
        "base": "mid", "name": "leaf",
        "optim": {"max_steps": None, "epochs": 1},           # switch the budget
        "data": {"source": None, "sources": [{"source": "chatterbot-corpus", "count": 12}]}})
    s = load_spec(leaf)
    assert s.drafter.block_size == 8 and s.optim.epochs == 1 and s.optim.max_steps is None
    assert s.data.source is None and s.data.sources[0].count == 12


@pytest.mark.parametrize("doc, where, what", [
    # the child's own field: the child is named
    ({"loss": {"gamma": -1}}, "child.yaml: field 'loss.gamma'", "minimum of 0"),
    ({"optim": {"lrr": 1}}, "child.yaml: unknown field 'optim.lrr'", "did you mean 'lr'"),
    # a cross-field rule whose field the base set: the base is named, as the child's base
    ({"drafter": {"block_size": 256}}, "micro.yaml (base of ",
     "field 'batching.num_buckets'"),
    ({"base": "nope"}, "child.yaml: field 'base'", "not found"),
    ({"base": "child"}, "child.yaml: field 'base'", "cycle"),
    ({"base": 3}, "child.yaml: field 'base'", "must be a spec name"),
    ({"name": "micro"}, "child.yaml: field 'name'", "a spec with a base sets its own name"),
])
def test_child_errors_name_the_file_and_field(specs, doc, where, what):
    child = _write(specs / "child.yaml", {"base": "micro", "name": "child", **doc})
    with pytest.raises(SpecError) as e:
        load_spec(child)
    assert where in str(e.value) and what in str(e.value), str(e.value)


def test_broken_base_is_named_with_its_child(specs):
    (specs / "bad.yaml").write_text("name: bad\nloss: [\n")
    child = _write(specs / "child.yaml", {"base": "bad", "name": "child"})
    with pytest.raises(SpecError) as e:
        load_spec(child)
    msg = str(e.value)
    assert msg.startswith(f"{specs / 'bad.yaml'}: not valid YAML") and "the base of" in msg


def test_validate_show_prints_the_merged_spec(specs):
    child = _write(specs / "child.yaml", {"base": "micro", "name": "child", "loss": {"gamma": 3}})
    r = subprocess.run([sys.executable, "-m", "dflash", "validate", "--show", str(child)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout.split(f"--- # {child} as validated\n", 1)[1])
    assert shown["name"] == "child" and shown["loss"]["gamma"] == 3
    assert shown["target"]["model"] == "llama-micro"       # from the base
    assert shown["optim"]["beta2"] == 0.95                  # a schema default, filled in
    assert "base" not in shown


def _sweep(tmp_path: Path, doc: dict, name: str = "sw") -> Path:
    return _write(tmp_path / "sweeps" / f"{name}.yaml", doc)


def test_sweep_arms_grid_seeds_and_repeats(specs, tmp_path):
    sw = load_sweep(_sweep(tmp_path, {
        "base": "micro", "seed": 5, "overrides": {"optim": {"max_steps": 4}},
        "arms": {"a": {"optim": {"lr": 3e-4}}, "b": {"optim": {"beta2": 0.999}, "seed": 9}},
        "grid": {"loss.gamma": {"g2": 2, "g6": 6}, "optim.lr": {"hi": 2e-3}}}))
    got = {a.arm: (a.name, a.seed) for a in sw.arms}
    assert got == {"a": ("sw-a", 5), "b": ("sw-b", 9), "g2-hi": ("sw-g2-hi", 5),
                   "g6-hi": ("sw-g6-hi", 5)}
    by = {a.arm: a.spec for a in sw.arms}
    assert by["a"].optim.lr == 3e-4 and by["a"].optim.max_steps == 4
    assert by["b"].optim.beta2 == 0.999 and by["g6-hi"].loss.gamma == 6
    assert by["g6-hi"].optim.lr == 2e-3
    rep = load_sweep(_sweep(tmp_path, {"base": "micro", "repeats": 3, "arms": {"x": {}}}, "rp"))
    assert [(a.name, a.seed) for a in rep.arms] == [("rp-x-r0", 0), ("rp-x-r1", 1),
                                                    ("rp-x-r2", 2)]
    # a different seed is a different data and warm-up key; a training field is not
    assert rep.arms[0].spec.fingerprint("data") != rep.arms[1].spec.fingerprint("data")
    assert by["a"].fingerprint("data") == by["g2-hi"].fingerprint("data")


@pytest.mark.parametrize("doc, what", [
    ({"base": "micro"}, "give 'arms' or 'grid'"),
    ({"base": "nope", "arms": {"a": {}}}, "field 'base': base spec 'nope' not found"),
    ({"base": "micro", "arms": {"A.b": {}}}, "field 'arms'"),
    ({"base": "micro", "arms": {"a": {"optim": {"lr": -1}}}},
     "sw.yaml arm 'a': field 'optim.lr'"),
    ({"base": "micro", "arms": {"a": {"drafter": {"block_size": 256}}}},
     "micro.yaml (base of "),
    ({"base": "micro", "arms": {"a": {"name": "x"}}}, "arm 'a': field 'name'"),
    ({"base": "micro", "arms": {"a" * 40: {}}}, "field 'arms'"),
])
def test_bad_sweeps_are_one_message_naming_file_arm_and_field(specs, tmp_path, doc, what):
    with pytest.raises(SpecError) as e:
        load_sweep(_sweep(tmp_path, doc))
    assert what in str(e.value), str(e.value)


def test_materialised_arms_load_as_specs_and_are_rewritten_only_on_change(specs, tmp_path):
    sw = load_sweep(_sweep(tmp_path, {"base": "micro", "arms": {"a": {"loss": {"gamma": 3}}}}))
    files = materialise(sw, tmp_path / "results")
    path = files["sw-a"]
    assert path == tmp_path / "results" / "sw.sweep" / "specs" / "sw-a.yaml"
    assert load_spec(path) == sw.arms[0].spec
    mtime = path.stat().st_mtime_ns
    materialise(sw, tmp_path / "results")
    assert path.stat().st_mtime_ns == mtime
    # an arm that would shadow a spec is refused
    _sweep(tmp_path, {"base": "micro", "arms": {"a": {}}}, "micro")
    with pytest.raises(SpecError, match="also a spec's name"):
        load_sweeps(tmp_path / "sweeps", tmp_path / "results", {"micro": None})


def test_repo_sweeps_validate():
    for p in sorted((REPO / "sweeps").glob("*.yaml")):
        sw = load_sweep(p)
        assert len(sw.arms) >= 2, p
    recipe = {a.arm: a.spec for a in load_sweep(REPO / "sweeps" / "smollm2-recipe.yaml").arms}
    assert recipe["gamma4"].loss.gamma == 4 and recipe["beta2-0999"].optim.beta2 == 0.999
    assert {recipe[a].optim.lr for a in ("ref", "lr12e-4", "lr24e-4")} == {6e-4, 1.2e-3, 2.4e-3}
    # every arm but the data arms shares the base's one data stage; its warm-up too, but for the arms that change
    # a compiled shape: depth and block (the drafter, the row), uncapped and kd / ce-kd (the loss's rows and inputs)
    # the base's 30.6K steered prompts since round 19 (steered-gamma4-depth8's): only prompts1x
    # (round 13's 20.6K) and round17 (the same count unsteered) have a data stage of their own;
    # the arms that became the base (gamma4, depth8, steered, steered-gamma4-depth8) equal ref
    # code-2ep: the code spec's data stage, shared with specs/smollm2-code.yaml by content
    # prompts2x-3ep: twice the steered prompts (60K self-written), no feature cache, the base's
    # warm-up; greedy-prompts2x: as many, one greedy answer each, trained as the base
    own_data = ("prompts1x", "round17", "code-2ep", "prompts2x-3ep", "greedy-prompts2x")
    assert len({s.fingerprint("data") for k, s in recipe.items() if k not in own_data}) == 1
    assert len({recipe[k].fingerprint("data") for k in ("ref",) + own_data}) == 6
    # round 26: the base trains on soft labels (kd) for 8 epochs; the ce arm is the base until
    # then (CE for 6 epochs, round 19's run: the ref its folders lend, bench/ablation_ref.py)
    ref, ce, kd = recipe["ref"], recipe["ce"], recipe["kd"]
    assert (ref.loss.kind, ref.optim.epochs, ref.features.cache) == ("kd", 8, "host")
    assert (ce.loss.kind, ce.optim.epochs) == ("ce", 6)
    assert ce.fingerprint("data") == ref.fingerprint("data")
    assert ce.fingerprint("warmup") != ref.fingerprint("warmup")    # the loss's inputs
    # the arms whose runs were CE's keep it pinned (their records read as what they ran):
    # prompts2x-3ep twice the steered prompts, no feature cache; greedy-prompts2x as many, one
    # greedy answer each, trained as ce; epochs10 (round 22) and epochs9; code-2ep the code spec's
    fresh = recipe["prompts2x-3ep"]
    assert fresh.fingerprint("warmup") == ce.fingerprint("warmup")
    assert fresh.data.self_written.categories == ref.data.self_written.categories
    assert (fresh.data.max_prompts, fresh.optim.epochs, fresh.features.cache) == (60600, 3, "off")
    greedy = recipe["greedy-prompts2x"]
    assert all(greedy.fingerprint(st) == ce.fingerprint(st) for st in ("warmup", "train"))
    assert greedy.data.self_written == ref.data.self_written
    # the base's sample count (one greedy answer to each of twice the prompts) and cache
    assert (greedy.data.temperature, greedy.data.samples_per_prompt) == (0.0, 1)
    assert (ref.data.temperature, ref.data.samples_per_prompt) == (0.6, 2)
    assert abs(greedy.data.max_prompts - 2 * ref.data.max_prompts) <= 600
    assert greedy.features.cache == ref.features.cache == "host"
    for arm, epochs in (("epochs10", 10), ("epochs9", 9)):
        assert (recipe[arm].loss.kind, recipe[arm].optim.epochs) == ("ce", epochs)
        assert recipe[arm].fingerprint("warmup") == ce.fingerprint("warmup")
        assert recipe[arm].fingerprint("train") != ce.fingerprint("train")
    # kd: round 24's run, the base's data, shapes and objective for 6 epochs (the epochs6 arm's
    # training since round 26); kd-epochs8 is the base's training (round 26's run), 10 its own
    assert (kd.loss.kind, kd.optim.epochs, kd.features.cache) == ("kd", 6, "host")
    assert all(kd.fingerprint(st) == ref.fingerprint(st) for st in ("data", "warmup"))
    assert recipe["epochs6"].fingerprint("train") == kd.fingerprint("train") != ref.fingerprint("train")
    assert recipe["kd-epochs8"].fingerprint("train") == ref.fingerprint("train")
    assert recipe["kd-epochs10"].optim.epochs == 10
    assert recipe["kd-epochs10"].fingerprint("train") != ref.fingerprint("train")
    # greedy's and kd's bench is the quality spec's whole bench (their DAG bounds the default's
    # 20 minutes); the longer kd arms take the sweep's (τ first: round 25's whole-bench 8 epochs
    # did not fit its hold), so they have no decoders stage
    quality = load_spec(REPO / "specs" / "smollm2-quality.yaml")
    assert quality.fingerprint("train") == ref.fingerprint("train")
    for arm in (greedy, kd):
        assert (arm.bench.protocols, arm.bench.decode_batches) == (
            quality.bench.protocols, quality.bench.decode_batches)
    for n in (8, 10):
        longer = recipe[f"kd-epochs{n}"]
        assert (longer.bench.protocols, longer.bench.decode_batches) == (("dflash",), ())
        assert "decode_batches is []" in no_decoders_stage(longer)
    code = load_spec(REPO / "specs" / "smollm2-code.yaml")
    assert all(recipe["code-2ep"].fingerprint(st) == code.fingerprint(st) for st in ("data", "warmup"))
    assert (recipe["code-2ep"].optim.epochs, code.optim.epochs) == (2, 6)
    for arm in ("gamma4", "depth8", "steered", "steered-gamma4-depth8"):
        assert all(recipe[arm].fingerprint(st) == ref.fingerprint(st)
                   for st in ("data", "warmup", "train")), arm
    assert (ref.loss.gamma, ref.drafter.num_layers) == (4, 8)
    # round17: the base until round 19, unsteered (the data fingerprint of round 17's dataset),
    # γ 7, 5 layers (a warm-up of its own)
    old = recipe["round17"]
    assert (old.loss.gamma, old.drafter.num_layers) == (7, 5)
    assert old.data.self_written.categories == () and old.data.self_written.max_tokens == 128
    # the steered prompts: the base's prompts and budget, written under MT-Bench's eight
    # categories
    steered = ref.data
    assert set(steered.self_written.categories) == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert (old.data.max_prompts, old.data.max_new_tokens) == (steered.max_prompts,
                                                               steered.max_new_tokens)
    # prompts15x pins round 15's 3 epochs, prompts15x-2ep 2, prompts1x round 13's 3
    assert recipe["prompts15x"].fingerprint("train") != ref.fingerprint("train")
    assert (recipe["prompts15x"].optim.epochs, recipe["prompts15x-2ep"].optim.epochs) == (3, 2)
    assert recipe["prompts1x"].optim.epochs == 3
    assert recipe["prompts1x"].data.max_prompts == 20600 and ref.data.max_prompts == 30600
    assert recipe["prompts15x-2ep"].fingerprint("warmup") == ref.fingerprint("warmup")
    # compiled shapes: the base's (kd), the CE arms' (above), and the arms that change one:
    # depth and block (the drafter, the row), uncapped and ce-kd (the loss's rows and inputs)
    own = ("depth3", "round17", "block8", "block8-anchors2x", "anchors1344", "uncapped", "ce-kd")
    ce_arms = ("ce", "epochs10", "epochs9", "prompts2x-3ep", "greedy-prompts2x", "code-2ep")
    # the feature cache's place is no compiled shape: block 8 on the GPU's cache is block 8's
    shares = {"block8-device-cache": "block8"}
    assert {s.fingerprint("warmup") for k, s in recipe.items()
            if k not in own + ce_arms and k not in shares} == {ref.fingerprint("warmup")}
    assert {recipe[k].fingerprint("warmup") for k in ce_arms} == {ce.fingerprint("warmup")}
    assert len({s.fingerprint("warmup") for s in recipe.values()}) == 2 + len(own)
    for arm, other in shares.items():
        assert recipe[arm].fingerprint("warmup") == recipe[other].fingerprint("warmup")
        assert recipe[arm].fingerprint("train") != recipe[other].fingerprint("train")


def test_store_links_survive_deleting_one_spec(tmp_path):
    store = tmp_path / "results" / ".shared" / "data-k"
    (store / "data" / "shards").mkdir(parents=True)
    (store / "data" / "manifest.json").write_text('{"checksum": "c1"}')
    (store / "data" / "dataset.parquet").write_bytes(b"x" * 100)
    (store / "data" / "shards" / "part-0.parquet").write_bytes(b"y")
    a, b = tmp_path / "results" / "a", tmp_path / "results" / "b"
    assert link_stage(store, "data", a) == 3 and link_stage(store, "data", b) == 3
    ds = store / "data" / "dataset.parquet"
    assert os.path.samefile(a / "data" / "dataset.parquet", ds)
    assert ds.stat().st_nlink == 3

    shutil.rmtree(a)                                   # one spec's results, deleted by hand
    assert ds.read_bytes() == b"x" * 100 and (b / "data" / "dataset.parquet").is_file()
    # the store rewritten (atomically: a new file): b keeps what it linked until relinked
    tmp = ds.with_suffix(".tmp")
    tmp.write_bytes(b"z")
    os.replace(tmp, ds)
    assert (b / "data" / "dataset.parquet").read_bytes() == b"x" * 100
    link_stage(store, "data", b)
    assert (b / "data" / "dataset.parquet").read_bytes() == b"z"
    assert sorted(p.name for p in (b).iterdir()) == ["data"]     # no temp folders left
    with pytest.raises(StaleArtifact, match="no manifest"):
        link_stage(tmp_path / "nowhere", "data", b)


def test_share_key_is_the_content():
    k = share_key("data", {"data": {"max_prompts": 12}}, "code1", {"env": "e"})
    assert k == share_key("data", {"data": {"max_prompts": 12}}, "code1", {"env": "e"})
    assert len({k, share_key("data", {"data": {"max_prompts": 13}}, "code1", {"env": "e"}),
                share_key("data", {"data": {"max_prompts": 12}}, "code2", {"env": "e"}),
                share_key("data", {"data": {"max_prompts": 12}}, "code1", {"env": "f"}),
                share_key("warmup", {"data": {"max_prompts": 12}}, "code1", {"env": "e"})}) == 5
