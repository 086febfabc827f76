"""Security basics (issue 9, item 6).

Nothing from a spec reaches a shell unquoted or a path outside results/ and logs/; weights load
via safetensors (or ``weights_only=True``); no ``trust_remote_code``; no eval/exec of
configuration; nothing is unpickled; YAML is only ever read with the safe loader.

The package checks are static (an AST scan of every module under dflash/); the scanner is itself
tested on a snippet that breaks every rule, so a check can never pass vacuously.
"""
from __future__ import annotations

import ast
import copy
import inspect
import re
import shlex
import types
from pathlib import Path

import pytest
import yaml
from snakemake.utils import format as smk_format

import dflash.env.drift
import dflash.stages
import dflash.stages.env
from dflash.cli import main
from dflash.errors import SpecError
from dflash.runtime.resources import srun
from dflash.spec.load import load_spec, parse_spec, schema
from dflash.stages import results_dir

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dflash"
BASE = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())

SUBPROCESS_FNS = {"run", "call", "check_call", "check_output", "Popen"}
SHELL_FNS = {"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
             "asyncio.create_subprocess_shell", "pty.spawn", "commands.getoutput"}
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                  "joblib"}
YAML_UNSAFE = {"yaml.load", "yaml.load_all", "yaml.full_load", "yaml.full_load_all",
               "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.compose", "yaml.compose_all",
               "yaml.parse", "yaml.scan"}
YAML_SAFE_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


# ---------------------------------------------------------------------------------------------
# the scanner
# ---------------------------------------------------------------------------------------------
def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> full dotted name, from the module's imports (anywhere in it)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _kw(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _stringy(node: ast.AST) -> bool:
    """A command given as one string (which only a shell would split)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.JoinedStr):
        return True
    if isinstance(node, ast.BinOp):
        return _stringy(node.left) or _stringy(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in ("join", "format") and _stringy(node.func.value)
    return False


def _safe_loader(node, aliases) -> bool:
    """``yaml.SafeLoader``-like, or ``getattr(yaml, "CSafeLoader", yaml.SafeLoader)``."""
    if node is None:
        return False
    if isinstance(node, ast.Call) and _dotted(node.func, aliases) == "getattr":
        return (len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in YAML_SAFE_LOADERS and _safe_loader(node.args[2], aliases))
    name = _dotted(node, aliases)
    return bool(name) and name.split(".")[-1] in YAML_SAFE_LOADERS


def violations(source: str, filename: str = "<src>") -> list[tuple[str, int, str]]:
    """``(rule, line, detail)`` for every unsafe construct in ``source``."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    out: list[tuple[str, int, str]] = []

    def add(rule, node, detail=""):
        out.append((rule, node.lineno, detail))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for m in mods:
                if m and m.split(".")[0] in PICKLE_MODULES:
                    add("pickle", node, m)
        if isinstance(node, ast.Attribute) and node.attr in ("Loader", "UnsafeLoader",
                                                             "FullLoader", "CLoader",
                                                             "CFullLoader", "CUnsafeLoader"):
            if _dotted(node, aliases) and _dotted(node, aliases).startswith("yaml."):
                add("yaml", node, _dotted(node, aliases))
        if isinstance(node, ast.keyword):
            if node.arg == "trust_remote_code" and not _is_const(node.value, False):
                add("trust_remote_code", node.value)
            if node.arg == "weights_only" and not _is_const(node.value, True):
                add("weights_only", node.value)
            if node.arg == "use_safetensors" and _is_const(node.value, False):
                add("weights_only", node.value, "use_safetensors=False")
            if node.arg == "allow_pickle" and not _is_const(node.value, False):
                add("pickle", node.value, "allow_pickle")
            if node.arg == "shell" and not _is_const(node.value, False):
                add("shell", node.value, "shell=...")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, aliases) or ""
        if isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec", "compile"):
            add("eval", node, node.func.id)
        if name in ("__import__", "importlib.import_module"):
            arg = node.args[0] if node.args else None
            fixed = ((isinstance(arg, ast.JoinedStr) and arg.values
                      and isinstance(arg.values[0], ast.Constant)
                      and str(arg.values[0].value).startswith("dflash."))
                     or (isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                         and arg.value.startswith("dflash.")))
            if not fixed:       # only dflash's own modules, by a fixed prefix
                add("eval", node, name)
        if name in ("torch.load", "torch.serialization.load") and \
                not _is_const(_kw(node, "weights_only"), True):
            add("weights_only", node, name)
        if name in ("torch.save", "pandas.read_pickle") or name.endswith(".read_pickle"):
            add("pickle", node, name)
        if name in SHELL_FNS:
            add("shell", node, name)
        if name.startswith(("os.spawn", "os.exec")):
            # the one allowed form: replacing this process with its own interpreter
            # (dflash/runtime/launch.py: `python -m torch.distributed.run ...`, an argv list, no shell)
            first = node.args[0] if node.args else None
            if not (first is not None and _dotted(first, aliases) == "sys.executable"):
                add("shell", node, name)
        if name.startswith("subprocess.") and name.split(".")[-1] in SUBPROCESS_FNS:
            cmd = node.args[0] if node.args else _kw(node, "args")
            if cmd is not None and _stringy(cmd):
                add("shell", node, f"{name} with a command string")
        if name in YAML_UNSAFE:
            loader = _kw(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if not _safe_loader(loader, aliases):
                add("yaml", node, name)
        if name.endswith(".from_pretrained") or name.endswith(".from_config"):
            if _kw(node, "trust_remote_code") is not None and \
                    not _is_const(_kw(node, "trust_remote_code"), False):
                add("trust_remote_code", node, name)
    return out


def package_sources() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 15, files
    return files


def package_violations(rule: str) -> list[str]:
    found = []
    for f in package_sources():
        for r, line, detail in violations(f.read_text(), str(f)):
            if r == rule:
                found.append(f"{f.relative_to(REPO)}:{line}: {detail}")
    return found


BAD_SNIPPET = '''
import pickle
import subprocess as sp
import torch, yaml, os
from transformers import AutoModelForCausalLM
cfg = eval(open("x").read())
exec("print(1)")
mod = __import__(user_value)
m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
sd = torch.load(path)
sd2 = torch.load(path, weights_only=False)
torch.save(sd, "x.pt")
sp.run("ls " + name, shell=True)
sp.check_output(f"echo {name}")
os.system("rm -rf " + name)
os.execv("/bin/sh", ["sh", "-c", name])
d = yaml.load(text, Loader=yaml.Loader)
d2 = yaml.load(text)
d3 = yaml.load(text, Loader=getattr(yaml, "CLoader", yaml.SafeLoader))
'''


def test_scanner_catches_every_rule():
    rules = {r for r, _, _ in violations(BAD_SNIPPET)}
    assert rules == {"pickle", "eval", "trust_remote_code", "weights_only", "shell", "yaml"}
    details = [d for _, _, d in violations(BAD_SNIPPET)]
    assert "os.system" in details and "subprocess.check_output with a command string" in details
    assert "os.execv" in details  # any other program than this interpreter
    assert "torch.load" in details and "torch.save" in details
    clean = '''
import os, subprocess, sys, torch, yaml
from safetensors.torch import load_file
subprocess.run([sys.executable, "-m", "pip", "install", path], check=True)
os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "-m", "dflash"])
model.eval()
torch.compile(fn)
re.compile("x")
sd = torch.load(p, weights_only=True)
d = yaml.safe_load(text)
root = yaml.compose(text, Loader=yaml.SafeLoader)
root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
m = __import__(f"dflash.{name}", fromlist=["run"])
'''
    assert violations(clean) == []


# ---------------------------------------------------------------------------------------------
# the package
# ---------------------------------------------------------------------------------------------
def test_no_eval_or_exec_of_configuration():
    assert package_violations("eval") == []


def test_no_trust_remote_code():
    assert package_violations("trust_remote_code") == []
    for f in [*package_sources(), *REPO.glob("rules/*.smk"), REPO / "Snakefile"]:
        text = f.read_text()
        assert not re.search(r"trust_remote_code\s*[=:]\s*True", text), f


def test_weights_never_unpickled():
    assert package_violations("weights_only") == []
    assert package_violations("pickle") == []
    # checkpoints and exported drafters are written and read with safetensors
    for mod in ("train/checkpoint.py", "models/drafter.py"):
        text = (PACKAGE / mod).read_text()
        assert "safetensors" in text, mod


def test_transformers_loads_bin_weights_with_weights_only():
    """A user's HF folder with pytorch_model.bin is read by transformers' torch.load with
    weights_only=True (its default; the package never overrides it, see above)."""
    mu = pytest.importorskip("transformers.modeling_utils")
    assert inspect.signature(mu.load_state_dict).parameters["weights_only"].default is True


def test_no_shell():
    assert package_violations("shell") == []
    for f in package_sources():
        assert "shell=True" not in f.read_text(), f


def test_yaml_only_safe_loader():
    assert package_violations("yaml") == []


# ---------------------------------------------------------------------------------------------
# spec values that become paths
# ---------------------------------------------------------------------------------------------
EVIL_NAMES = ["..", ".", "../x", "a/b", "/abs", "a\\b", "my spec", "$(touch pwned)", "`id`",
              "x;ls", "x|y", "x&y", "x>y", "a\nb", "Tiny", "naïve", "", "a" * 65, "~root",
              "*", "x'y", 'x"y', "{spec}"]


def test_name_schema_admits_only_path_safe_names():
    sch = schema()["properties"]["name"]
    assert sch["pattern"] == "^[a-z0-9_-]+$" and sch["maxLength"] <= 255
    for name in EVIL_NAMES:
        data = copy.deepcopy(BASE)
        data["name"] = name
        with pytest.raises(SpecError, match=r"field 'name'"):
            parse_spec(data, "specs/x.yaml")


@pytest.mark.parametrize("name", ["tiny", "a", "x-1_b", "-", "0"])
def test_valid_names_stay_inside_results_and_logs(name, tmp_path):
    data = copy.deepcopy(BASE)
    data["name"] = name
    spec = parse_spec(data, f"specs/{name}.yaml")
    for root in (tmp_path / "results", tmp_path / "logs"):
        p = results_dir(spec, root).resolve()
        assert p.parent == root.resolve() and p.name == name


@pytest.mark.parametrize("stage", ["env", "warmup", "data", "train", "bench"])
@pytest.mark.parametrize("name", ["..", "../../etc", "a/b"])
def test_bad_name_refused_before_any_path_is_built(stage, name, tmp_path, monkeypatch, capsys):
    built = []
    monkeypatch.setattr(dflash.stages, "results_dir", lambda *a: built.append(a))
    monkeypatch.setattr(dflash.stages.env, "run", lambda *a: built.append(a))
    monkeypatch.setattr(dflash.env.drift, "check_env", lambda *a, **k: built.append(a))
    monkeypatch.chdir(tmp_path)
    data = copy.deepcopy(BASE)
    data["name"] = name
    path = tmp_path / "specs" / "evil.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(data))
    assert main([stage, str(path), "--results", str(tmp_path / "results")]) != 0
    err = capsys.readouterr().err
    assert f"error: {path}: field 'name'" in err and "Traceback" not in err
    assert built == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["specs"]


@pytest.mark.parametrize("lock", ["/etc/passwd", "../x.lock", "envs/../../x.lock"])
def test_lock_path_must_stay_in_the_repository(lock):
    data = copy.deepcopy(BASE)
    data["env"] = {"lock": lock}
    with pytest.raises(SpecError, match=r"field 'env.lock'"):
        parse_spec(data, "specs/tiny.yaml")


# ---------------------------------------------------------------------------------------------
# Snakemake: what reaches the shell
# ---------------------------------------------------------------------------------------------
RULE_FILES = sorted(REPO.glob("rules/*.smk"))
STAGES = ["env", "warmup", "data", "decoders", "train", "bench"]


def test_rules_run_only_the_stage_command():
    shells = []
    for f in [REPO / "Snakefile", *RULE_FILES]:
        text = f.read_text()
        assert not re.search(r"^\s*(run|script|notebook|wrapper|cwl):", text, re.M), f
        assert "shell(" not in text, f
        for m in re.finditer(r"^\s*shell:\s*\n\s*(.+)$", text, re.M):
            shells.append((f.name, m.group(1).strip()))
    # train's command may start with its `launch` resource (srun on a multi-node SLURM job);
    # env, warmup and data run once per store key (shared_stage_cmd: stage_cmd with the store
    # folder as --at/--env-at, quoted); the two local jobs of the shared stores and sweeps run
    # the package's own tools with quoted params (rules/common_share.smk)
    shared = ("env", "warmup", "data")
    want = [f'stage_cmd("{s}", launch=True)' if s == "train" else
            f'shared_stage_cmd("{s}")' if s in shared else f'stage_cmd("{s}")' for s in STAGES]
    want += ["link_cmd()", "sweep_report_cmd()"]
    assert sorted(s.split("#")[0].strip() for _, s in shells) == sorted(want), shells


def test_rule_params_are_derived_not_raw_config():
    for f in RULE_FILES:
        text = f.read_text()
        for block in re.findall(r"^    params:\n((?:        .*\n)+)", text, re.M):
            for line in block.splitlines():
                key, _, value = line.strip().partition("=")
                if key.startswith("**"):  # a rule's whole params from one derived function
                    key, value = "", key
                value = value.split("#")[0].strip().rstrip(",")
                assert re.fullmatch(r"(python_for|lock_sha|spec_file|upstream\([\"\w, ]+\)|"
                                    r"spec_params\(\"\w+\"\)|code_hash\(\"\w+\"\)|"
                                    r"\*\*shared_params\(\"\w+\"\)|\*\*link_params\(\)|"
                                    r"sweep_python|sweep_arms|"
                                    r"lambda wc: str\(SWEEPS\[wc\.sweep\]\.path\.relative_to"
                                    r"\(workflow\.basedir\)\))", value), f"{f.name}: {line}"
        if f.name != "common.smk":      # config values enter only via common.smk's constants
            assert not re.search(r"\bconfig\b", text), f
    common = (REPO / "rules" / "common.smk").read_text()
    assert re.findall(r"\bconfig(?:\[|\.get)\S*", common) == [
        'config["default_spec"]', 'config["results"]', 'config["logs"]', 'config["benchmarks"]',
        'config["slurm"]',  # a boolean (config.schema.yaml): jobs go to a SLURM cluster
        'config["gpu_jobs"]',  # an integer 1..16 (config.schema.yaml): a resource's capacity
        'config.get("gpu_memory_gb")',  # a number >= 0 (config.schema.yaml) or absent
    ], common


def _common_fn(name: str, results: str = "results"):
    """A function as defined in rules/common.smk, with RESULTS set to ``results``."""
    text = (REPO / "rules" / "common.smk").read_text()
    m = re.search(rf"^def {name}\(.*\):\n(?:(?:    .*)?\n)+", text, re.M)
    assert m, f"rules/common.smk defines {name}"
    ns = {"shlex": shlex, "RESULTS": results}
    exec(compile(m.group(0), f"rules/common.smk:{name}", "exec"), ns)  # test-side only
    return ns[name]


@pytest.mark.parametrize("stage", STAGES)
def test_stage_command_quotes_every_value(stage):
    evil = {"python": "/w d/.venvs/x;touch pwned-1/bin/python",
            "spec": "specs/t.yaml",
            "results": "/r s/$(touch pwned)/{x}`id`",
            "log": "/l g/a'b\";c/t.log"}
    launch = stage == "train"
    template = _common_fn("stage_cmd", evil["results"])(stage, launch=launch)
    # every placeholder is a rule's own param/input/log, shell-quoted with :q; train's command
    # may start with its `launch` resource, unquoted on purpose (srun's words) and made of
    # integers only (below)
    holes = re.findall(r"(?<!\{)\{([^{}]+)\}(?!\})", template)
    quoted = [h for h in holes if h != "resources.launch"]
    assert quoted and all(h.endswith(":q") for h in quoted), template
    assert {h[:-2] for h in quoted} <= {"params.python", "params.spec", "log", "output"}, holes
    assert ("resources.launch" in holes) == launch and template.startswith("{resources.launch}"
                                                                         ) == launch
    base = [evil["python"], "-m", "dflash", stage, evil["spec"], "--results", evil["results"],
            "2>&1", "|", "tee", evil["log"]]
    for prefix in (["", srun(2)] if launch else [""]):
        cmd = smk_format(template, params=types.SimpleNamespace(python=evil["python"],
                                                                spec=evil["spec"]),
                         log=evil["log"], resources=types.SimpleNamespace(launch=prefix))
        assert shlex.split(cmd) == shlex.split(prefix) + base


def test_launch_prefix_is_built_from_an_integer_only():
    assert shlex.split(srun(3)) == ["srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                                    "--cpus-per-task=${SLURM_CPUS_PER_TASK:-1}",
                                    "--kill-on-bad-exit=1"]


def test_spec_names_in_snakemake_paths_are_validated():
    """The {spec} wildcard only matches the names of specs that passed validation."""
    text = (REPO / "rules" / "common.smk").read_text()
    assert re.search(r'spec="\|"\.join\(SPECS\)', text), "wildcard_constraints spec=<names>"
    assert "load_spec(path)" in text


def test_spec_file_cannot_smuggle_code(tmp_path):
    p = tmp_path / "specs" / "x.yaml"
    p.parent.mkdir()
    p.write_text("name: x\nseed: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(p)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()
