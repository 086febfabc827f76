"""Bad input never crashes with a traceback and never writes under results/ (issue 9, item 5).

A table of malformed specs, each made from a valid copy of specs/tiny.yaml: every one is refused
with ONE message that names the spec file and the field path, a non-zero exit, no traceback and
nothing under results/. Most cases run in-process through ``dflash.spec.load.load_spec`` (what every
command calls first); a representative handful run through the real CLI (`dflash validate`, and
stage commands) to prove the user-facing path. Plus: broken data lines, a lock file with a bad
hash, a missing lock and a missing target model.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.cli import main
from dflash.data.prompts import load_prompts
from dflash.errors import DFlashError, SpecError
from dflash.models import target as T
from dflash.spec.load import check_devices, load_spec, parse_spec
from dflash.spec.types import TargetSpec
from dflash.stages import StageContext
from dflash.stages import env as env_stage

REPO = Path(__file__).resolve().parents[1]
BASE = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())


# ---------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------
def put(dotted: str, value):
    def f(s):
        *parents, last = dotted.split(".")
        node = s
        for p in parents:
            node = node[p]
        node[last] = value
    return f


def drop(dotted: str):
    def f(s):
        *parents, last = dotted.split(".")
        node = s
        for p in parents:
            node = node[p]
        del node[last]
    return f


def rename(dotted: str, new: str):
    def f(s):
        *parents, last = dotted.split(".")
        node = s
        for p in parents:
            node = node[p]
        node[new] = node.pop(last)
    return f


def both(*fs):
    def f(s):
        for g in fs:
            g(s)
    return f


class Case:
    """One malformed spec: a mutation of tiny.yaml (or raw text/bytes) and the message parts."""

    def __init__(self, id, expect, mut=None, text=None, raw=None, missing=False):
        self.id, self.expect, self.mut, self.text, self.raw = id, expect, mut, text, raw
        self.missing = missing     # no file at all

    def write(self, root: Path) -> Path:
        path = root / "specs" / f"{self.id}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.missing:
            return path
        if self.raw is not None:
            path.write_bytes(self.raw)
        elif self.text is not None:
            path.write_text(self.text)
        else:
            s = copy.deepcopy(BASE)
            s["name"] = self.id            # must equal the file stem; a case may override it
            self.mut(s)
            path.write_text(yaml.safe_dump(s, sort_keys=False, allow_unicode=True))
        return path


VALID_TEXT = yaml.safe_dump(BASE, sort_keys=False)

CASES = [
    # --- not a YAML mapping -----------------------------------------------------------------
    Case("yaml-tab", ["not valid YAML", "line 3", "\\t"],
         text="name: yaml-tab\ntarget:\n\tmodel: smollm2-135m-instruct\n"),
    Case("yaml-unclosed", ["not valid YAML", "line"],
         text="name: yaml-unclosed\ntopology: {targets: [cpu, drafters: [cpu]\n"),
    Case("yaml-python-tag", ["not valid YAML", "python/object/apply:os.system"],
         text="name: yaml-python-tag\nseed: !!python/object/apply:os.system ['touch pwned']\n"),
    Case("empty-file", ["spec file is empty"], text=""),
    Case("comments-only", ["spec file is empty"], text="# nothing here\n"),
    Case("yaml-list", ["must be a YAML mapping", "got list"], text="- " + VALID_TEXT.replace(
        "\n", "\n  ")),
    Case("yaml-scalar", ["must be a YAML mapping", "got str"], text="just some words\n"),
    Case("non-utf8", ["not a UTF-8 text file"],
         raw=b"name: non-utf8\n# caf\xe9 \xff\xfe\n" + VALID_TEXT.encode()),
    Case("no-such-file", ["spec file not found"], missing=True),
    # --- unknown / missing fields -----------------------------------------------------------
    Case("unknown-top", ["unknown field 'optmi'", "did you mean 'optim'"],
         rename("optim", "optmi")),
    Case("unknown-nested", ["unknown field 'drafter.blok_size'", "did you mean 'block_size'"],
         rename("drafter.block_size", "blok_size")),
    Case("unknown-no-hint", ["unknown field 'zzz'", "allowed:"], put("zzz", 1)),
    Case("unknown-int-key", ["unknown field '1'"], lambda s: s.update({1: 2})),
    Case("missing-section", ["missing required field 'batching'"], drop("batching")),
    Case("missing-field", ["missing required field 'batching.token_budget'"],
         drop("batching.token_budget")),
    Case("missing-name", ["missing required field 'name'"], drop("name")),
    Case("null-section", ["field 'batching'", "not of type 'object'"], put("batching", None)),
    # --- wrong types ------------------------------------------------------------------------
    Case("str-for-int", ["field 'batching.token_budget'", "'1024' is not of type 'integer'"],
         put("batching.token_budget", "1024")),
    Case("float-for-int", ["field 'batching.max_anchors'", "not of type 'integer'"],
         put("batching.max_anchors", 48.5)),
    Case("whole-float-for-int", ["field 'batching.token_budget'", "not of type 'integer'"],
         put("batching.token_budget", 1024.0)),
    Case("bool-for-int", ["field 'batching.max_batch_size'", "not of type 'integer'"],
         put("batching.max_batch_size", True)),
    Case("str-for-list", ["field 'topology.targets'", "not of type 'array'"],
         put("topology.targets", "cpu")),
    Case("bad-enum", ["field 'target.dtype'", "fp8"], put("target.dtype", "fp8")),
    Case("list-item-type", ["field 'target.layer_ids[4]'", "minimum"],
         put("target.layer_ids", [1, 2, 3, 4, -1])),
    # --- zero / negative / huge / non-finite numbers ------------------------------------------
    Case("token-budget-zero", ["field 'batching.token_budget'", "minimum"],
         put("batching.token_budget", 0)),
    Case("lr-negative", ["field 'optim.lr'"], put("optim.lr", -1)),
    Case("gamma-zero", ["field 'loss.gamma'"], put("loss.gamma", 0)),
    Case("block-size-one", ["field 'drafter.block_size'", "minimum of 2"],
         put("drafter.block_size", 1)),
    Case("max-anchors-huge", ["field 'batching.max_anchors'", "maximum"],
         put("batching.max_anchors", 10 ** 9)),
    Case("token-budget-huge", ["field 'batching.token_budget'", "maximum"],
         put("batching.token_budget", 2 ** 40)),
    Case("seed-negative", ["field 'seed'"], put("seed", -1)),
    Case("lr-nan", ["field 'optim.lr'", "not a finite number"], put("optim.lr", float("nan"))),
    Case("grad-clip-inf", ["field 'optim.grad_clip'", "not a finite number"],
         put("optim.grad_clip", float("inf"))),
    # --- cross-field rules ------------------------------------------------------------------
    Case("anchors-over-budget", ["field 'batching.max_anchors'", "exceed batching.token_budget"],
         put("batching.max_anchors", 1025)),
    Case("batch-over-budget", ["field 'batching.max_batch_size'"],
         both(put("batching.max_batch_size", 2000), put("batching.max_anchors", 8))),
    Case("too-many-buckets", ["field 'batching.num_buckets'"], put("batching.num_buckets", 7)),
    Case("data-over-budget", ["field 'data.max_new_tokens'", "token_budget"],
         put("data.max_new_tokens", 1000)),
    Case("greedy-samples-repeat", ["field 'data.samples_per_prompt'", "greedy answers"],
         put("data.samples_per_prompt", 2)),
    Case("epochs-and-steps", ["field 'optim'", "exactly one of 'epochs' or 'max_steps'"],
         put("optim.max_steps", 100)),
    Case("neither-epochs-nor-steps", ["field 'optim'", "exactly one"], drop("optim.epochs")),
    Case("layer-ids-length", ["field 'target.layer_ids'", "num_feature_layers = 5"],
         put("target.layer_ids", [1, 2])),
    Case("layer-ids-dup", ["field 'target.layer_ids'", "distinct"],
         put("target.layer_ids", [1, 1, 2, 3, 4])),
    # --- devices ----------------------------------------------------------------------------
    Case("device-gpu0", ["field 'topology.targets[0]'", "'gpu0' is not a device name"],
         put("topology.targets", ["gpu0"])),
    Case("device-negative", ["field 'topology.drafters[1]'", "'cuda:-1'"],
         put("topology.drafters", ["cpu", "cuda:-1"])),
    Case("device-leading-zero", ["field 'topology.targets[0]'", "'cuda:01'"],
         put("topology.targets", ["cuda:01"])),
    Case("device-duplicate", ["field 'topology.drafters'", "cuda:1 listed twice"],
         put("topology.drafters", ["cuda:1", "cuda:1"])),
    Case("device-shared", ["field 'topology'", "cuda:0 is both a target and a drafter",
                           "allow_shared_devices"],
         both(put("topology.targets", ["cuda:0"]), put("topology.drafters", ["cuda:0", "cuda:1"]))),
    Case("device-none", ["field 'topology.drafters'", "non-empty"], put("topology.drafters", [])),
    Case("nodes-zero", ["field 'topology.nodes'", "minimum of 1"], put("topology.nodes", 0)),
    Case("nodes-str", ["field 'topology.nodes'", "not of type 'integer'"],
         put("topology.nodes", "2")),
    Case("rendezvous-no-port", ["field 'topology.rendezvous'", "does not match"],
         both(put("topology.nodes", 2), put("topology.rendezvous", "node01"))),
    Case("rendezvous-port-range", ["field 'topology.rendezvous'", "port 70000 is out of range"],
         both(put("topology.nodes", 2), put("topology.rendezvous", "node01:70000"))),
    Case("rendezvous-one-node", ["field 'topology.rendezvous'", "only used with topology.nodes > 1"],
         put("topology.rendezvous", "node01:29500")),
    # --- names that become paths, and other paths -------------------------------------------
    Case("name-mismatch", ["field 'name'", "'other' must equal the file stem 'name-mismatch'"],
         put("name", "other")),
    Case("name-slash", ["field 'name'", "'a/b' does not match"], put("name", "a/b")),
    Case("name-dotdot", ["field 'name'", "'..' does not match"], put("name", "..")),
    Case("name-traversal", ["field 'name'", "does not match"], put("name", "../../etc")),
    Case("name-space", ["field 'name'", "'my spec' does not match"], put("name", "my spec")),
    Case("name-subshell", ["field 'name'", "does not match"], put("name", "$(touch pwned)")),
    Case("name-semicolon", ["field 'name'", "does not match"], put("name", "x;touch pwned")),
    Case("name-uppercase", ["field 'name'", "'Tiny' does not match"], put("name", "Tiny")),
    Case("name-too-long", ["field 'name'", "too long"], put("name", "a" * 65)),
    Case("lock-absolute", ["field 'env.lock'", "inside the repository"],
         put("env.lock", "/etc/passwd")),
    Case("lock-dotdot", ["field 'env.lock'", "inside the repository"],
         put("env.lock", "envs/../../outside.lock")),
]
IDS = [c.id for c in CASES]
assert len(CASES) >= 30 and len(set(IDS)) == len(IDS)


def test_table_is_made_from_a_valid_spec(tmp_path):
    p = tmp_path / "specs" / "tiny.yaml"
    p.parent.mkdir()
    p.write_text(VALID_TEXT)
    assert load_spec(p).name == "tiny"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_malformed_spec_one_clear_message(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = case.write(tmp_path)
    with pytest.raises(SpecError) as e:          # a SpecError, never another exception type
        load_spec(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg     # names the spec file ...
    for part in case.expect:                     # ... and the field
        assert part in msg, f"{part!r} not in {msg!r}"
    assert "\n" not in msg, msg
    assert not (tmp_path / "results").exists() and not (tmp_path / "pwned").exists()


def test_absent_device_in_process(tmp_path):
    path = Case("absent-device", [], put("topology.targets", ["cuda:0"])).write(tmp_path)
    spec = load_spec(path)                       # well-formed: only the device check refuses it
    with pytest.raises(SpecError) as e:
        check_devices(spec, found=["cpu"])
    msg = str(e.value)
    assert msg.startswith(f"{path}: field 'topology'") and "missing here: cuda:0" in msg
    assert "this machine has: cpu" in msg


# ---------------------------------------------------------------------------------------------
# the real CLI
# ---------------------------------------------------------------------------------------------
def _env(**extra) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    for k in ("DFLASH_ALLOW_DRIFT", "DFLASH_VENV_DIR"):
        e.pop(k, None)
    e.update(extra)
    return e


def dflash(*args, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash", *map(str, args)], cwd=cwd,
                          env=_env(**env), capture_output=True, text=True, timeout=300)


def assert_refused(r: subprocess.CompletedProcess, path: Path, expect: list[str], root: Path,
                   stage: bool = False) -> str:
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    line = errors[0]
    assert str(path) in line, line
    for part in expect:
        assert part in line, f"{part!r} not in {line!r}"
    if stage:   # the stage commands add one "what to do" line
        assert [ln for ln in r.stderr.splitlines() if ln != line] == [
            ln for ln in r.stderr.splitlines() if ln.startswith("what to do:")], r.stderr
    else:
        assert r.stderr.strip() == line and r.stdout == "", out
    assert not (root / "results").exists(), sorted(map(str, (root / "results").rglob("*")))
    assert not (root / "pwned").exists()
    return line


CLI_CASES = ["yaml-tab", "yaml-python-tag", "empty-file", "non-utf8", "unknown-nested",
             "str-for-int", "whole-float-for-int", "anchors-over-budget", "device-gpu0",
             "name-subshell", "unknown-int-key"]
BY_ID = {c.id: c for c in CASES}


ABSENT_DEVICE = Case("absent-device", [], both(put("topology.targets", ["cuda:0"]),
                                              put("topology.drafters", ["cuda:1"])))


def test_validate_cli_prints_one_line_per_bad_spec(tmp_path):
    """All the cases in one `dflash validate` call (one interpreter start, torch and transformers
    imported once instead of once per case): validate checks each file on its own, so each
    still gets exactly its one line, in the order given, naming its file and field; nothing else
    is printed but the count, and the exit is non-zero. A well-formed GPU spec last passes with
    --no-devices (its refusal with the devices checked: the test below)."""
    cases = [BY_ID[cid] for cid in CLI_CASES]
    paths = [c.write(tmp_path) for c in cases]
    good = ABSENT_DEVICE.write(tmp_path)
    r = dflash("validate", "--no-devices", *paths, good, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    assert r.stdout.startswith(f"ok: {good} (spec 'absent-device', devices cuda:0, cuda:1)\n"), out
    assert "error" not in r.stdout, out
    *lines, summary = r.stderr.splitlines()   # several files: validate ends with a count
    assert summary == f"1 of {len(cases) + 1} specs ok", r.stderr
    assert len(lines) == len(cases) and all(ln.startswith("error:") for ln in lines), r.stderr
    for case, path, line in zip(cases, paths, lines):
        assert str(path) in line, (case.id, line)
        for part in case.expect:
            assert part in line, f"{case.id}: {part!r} not in {line!r}"
    assert not (tmp_path / "results").exists(), sorted(map(str, (tmp_path / "results").rglob("*")))
    assert not (tmp_path / "pwned").exists()


def test_validate_cli_absent_device(tmp_path):
    """`validate` without --no-devices checks the devices exist (CUDA hidden: same on any box);
    the same spec passes with --no-devices (the test above)."""
    path = ABSENT_DEVICE.write(tmp_path)
    r = dflash("validate", path, cwd=tmp_path, CUDA_VISIBLE_DEVICES="")
    assert_refused(r, path, ["field 'topology'", "missing here: cuda:0, cuda:1",
                             "this machine has: cpu"], tmp_path)


@pytest.mark.parametrize("stage,cid", [("env", "unknown-top"), ("env", "device-shared"),
                                       ("env", "lock-dotdot"), ("env", "name-dotdot"),
                                       ("data", "data-over-budget"), ("train", "lr-nan"),
                                       ("warmup", "name-slash"), ("bench", "yaml-list")])
def test_stage_commands_refuse_the_same_way(stage, cid, tmp_path):
    case = BY_ID[cid]
    path = case.write(tmp_path)
    r = dflash(stage, path, "--results", tmp_path / "results", cwd=tmp_path)
    assert_refused(r, path, case.expect, tmp_path, stage=True)


# ---------------------------------------------------------------------------------------------
# broken data lines
# ---------------------------------------------------------------------------------------------
def _msg(role, text):
    return {"role": role, "content": text}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                            for ln in lines))
    return path


def good(i):
    return {"messages": [_msg("user", f"question number {i}?"), _msg("assistant", "answer")]}


def test_bad_data_lines_past_threshold_name_file_line_and_kind(tmp_path):
    path = write_jsonl(tmp_path / "convs.jsonl", [
        good(1),
        '{"messages": [{"role": "user", "content": "unterminated',      # line 2: invalid JSON
        {"messages": [_msg("robot", "hi")]},                            # line 3: unknown role
        {"messages": []},                                               # line 4: empty
        {"conversations": [{"from": "human", "value": "   "}]},         # line 5: empty user text
        "[1, 2, 3]",                                                    # line 6: not an object
        *[good(i) for i in range(7, 21)],
    ])
    with pytest.raises(DFlashError) as e:
        load_prompts(str(path), max_prompts=100, seed=0, max_bad_fraction=0.05)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"data.source {path}" in msg and "data.max_bad_fraction" in msg
    assert "5 of 20 records are bad" in msg
    assert f"first bad record at {path}:2: invalid_json" in msg
    for kind in ("invalid_json: 1", "unknown_role: 1", "empty_conversation: 1",
                 "empty_user_text: 1", "not_an_object: 1"):
        assert kind in msg, msg

    # under the threshold the same file loads, and every bad line is accounted for
    prompts, report = load_prompts(str(path), max_prompts=100, seed=0, max_bad_fraction=0.5)
    assert len(prompts) == 15 and report.bad == 5
    assert report.examples["unknown_role"] == [f"{path}:3 (turn 0 role='robot')"]
    assert report.examples["empty_conversation"] == [f"{path}:4"]


def test_data_source_problems_are_one_message(tmp_path):
    def refused(source, *parts):
        with pytest.raises(DFlashError) as e:
            load_prompts(str(source), max_prompts=10, seed=0, max_bad_fraction=0.05)
        assert "data.source" in str(e.value) and "\n" not in str(e.value)
        for p in parts:
            assert p in str(e.value), str(e.value)

    refused(tmp_path / "missing.jsonl", "missing.jsonl", "neither")
    (tmp_path / "x.csv").write_text("a,b\n")
    refused(tmp_path / "x.csv", "unsupported file type '.csv'")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    refused(tmp_path / "blank.jsonl", "no records found")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    refused(tmp_path / "junk.parquet", "not a readable parquet file")
    write_jsonl(tmp_path / "allbad.jsonl", ['{"messages": [{"role": "bot", "content": "x"}]}'])
    refused(tmp_path / "allbad.jsonl", f"{tmp_path / 'allbad.jsonl'}:1: unknown_role")


# ---------------------------------------------------------------------------------------------
# the env lock: bad hash (build mode, offline) and a missing lock
# ---------------------------------------------------------------------------------------------
from test_env import make_wheel  # noqa: E402  (one builder of test wheels)


def test_lock_with_bad_hash_refused_by_env_stage_cli(tmp_path):
    wheel = make_wheel(tmp_path / "wheels", "tiny-gamma", "1.0")
    good_hash = hashlib.sha256(wheel.read_bytes()).hexdigest()
    bad_hash = ("f" if good_hash[0] != "f" else "e") + good_hash[1:]
    lock = tmp_path / "envs" / "bad.lock"
    lock.parent.mkdir()
    lock.write_text(f"tiny-gamma==1.0 \\\n    --hash=sha256:{bad_hash}\n")
    path = Case("bad-lock", [], put("env", {"lock": "envs/bad.lock", "mode": "build",
                                             "wheel_dir": str(tmp_path / "wheels")})
                ).write(tmp_path)
    r = dflash("env", path, "--results", tmp_path / "results", cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "Traceback" not in out, out
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "envs/bad.lock" in errors[0] and "tiny-gamma==1.0" in errors[0]
    assert "hash check failed" in errors[0] and bad_hash[:16] in errors[0]
    assert not (tmp_path / "results").exists()


def test_missing_lock_file_is_one_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = copy.deepcopy(BASE)
    data["env"] = {"lock": "envs/nope.lock", "mode": "adopt"}
    spec = parse_spec(data, str(tmp_path / "specs" / "tiny.yaml"))
    with pytest.raises(DFlashError) as e:
        env_stage.run(StageContext(spec=spec, results=tmp_path / "results" / "tiny"))
    assert str(e.value) == "envs/nope.lock: lock file not found"
    assert not (tmp_path / "results").exists()


# ---------------------------------------------------------------------------------------------
# a missing target model
# ---------------------------------------------------------------------------------------------
def test_missing_target_model_names_target_model(tmp_path):
    (tmp_path / "no-config").mkdir()            # a folder, but without config.json
    for model in (str(tmp_path / "does-not-exist"), str(tmp_path / "no-config"), "qwen3-9b"):
        tgt = TargetSpec(model=model, init="pretrained", dtype="float32", num_feature_layers=5,
                         layer_ids=None, compile="auto")
        for fn in (lambda: T.hf_config(tgt), lambda: T.tokenizer_dir(model),
                   lambda: T.target_fingerprint(tgt)):
            with pytest.raises(SpecError) as e:
                fn()
            msg = str(e.value)
            assert msg.startswith(f"target.model: {model!r} is neither a built-in name"), msg
            assert "smollm2-135m-instruct" in msg and "config.json" in msg and "\n" not in msg
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("text", ['{"spec": "tiny", "step": 3', "[1, 2]", '{"updated_unix": "x"}',
                                  b"\xff\xfe garbage"])
def test_status_on_a_garbled_status_file_is_one_line(tmp_path, capsys, text):
    f = tmp_path / "train" / "status.json"
    f.parent.mkdir()
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["status", str(tmp_path)]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {f}: not a readable status file"), err
    assert "Traceback" not in out.err + out.out
