"""Every DFLASH_* switch lives in dflash/settings.py: read there only, at call time, and listed
in docs/design.md's table."""
from __future__ import annotations

import ast
import re

import pytest

from dflash import settings
from dflash.artifacts.code_fingerprint import PACKAGE_DIR
from dflash.runtime.harness import REPO

NAMES = {s.name for s in settings.SETTINGS}


def _environ_reads(tree: ast.AST) -> list[str]:
    """DFLASH_* names read from os.environ / os.getenv in a module."""
    out = []
    for n in ast.walk(tree):
        args = []
        if isinstance(n, ast.Subscript) and getattr(n.value, "attr", None) == "environ":
            args = [n.slice]
        elif isinstance(n, ast.Call) and (getattr(n.func, "attr", None) == "getenv" or (
                getattr(n.func, "attr", None) in ("get", "pop", "setdefault")
                and getattr(n.func.value, "attr", None) == "environ")):
            args = n.args[:1]
        out += [a.value for a in args if isinstance(a, ast.Constant)
                and str(a.value).startswith("DFLASH_")]
    return out


def test_only_settings_reads_the_environment_switches():
    offenders = {str(p.relative_to(PACKAGE_DIR)): _environ_reads(ast.parse(p.read_text()))
                 for p in PACKAGE_DIR.rglob("*.py") if p.name != "settings.py"}
    assert {k: v for k, v in offenders.items() if v} == {}
    # and the detector is not blind: settings.py itself reads through os.environ.get
    assert _environ_reads(ast.parse("import os\nos.environ.get('DFLASH_X')")) == ["DFLASH_X"]


def test_every_switch_named_anywhere_is_a_setting_and_in_the_design_table():
    named = set()
    for p in list(PACKAGE_DIR.rglob("*.py")) + list((REPO / "tests").glob("*.py")):
        named |= set(re.findall(r"\bDFLASH_[A-Z_]+[A-Z]\b", p.read_text()))
    named -= {"DFLASH_X", "DFLASH_NOPE"}  # this file's probes
    assert named <= NAMES, named - NAMES
    table = (REPO / "docs" / "design.md").read_text()
    assert [n for n in sorted(NAMES) if f"| `{n}` |" not in table] == []


def test_read_at_call_time(monkeypatch):
    monkeypatch.setenv("DFLASH_HEARTBEAT_S", "0.25")
    assert settings.heartbeat_s() == 0.25
    monkeypatch.delenv("DFLASH_HEARTBEAT_S")
    assert settings.heartbeat_s() == 1.0
    monkeypatch.setenv("DFLASH_GATE", "off")
    assert settings.gate_off()
    assert settings.rdzv_endpoint({"DFLASH_RDZV_ENDPOINT": "h:1"}) == "h:1"  # another env
    with pytest.raises(KeyError, match="not a dflash setting"):
        settings.get("DFLASH_NOPE")


def test_flex_kernel_options_parse_or_name_the_switch(monkeypatch):
    assert settings.flex_kernel_options() is None
    monkeypatch.setenv("DFLASH_FLEX_KERNEL_OPTIONS", "BLOCK_M=128, BLOCK_N=64,USE_TMA=false")
    assert settings.flex_kernel_options() == {"BLOCK_M": 128, "BLOCK_N": 64, "USE_TMA": 0}
    for bad in ("BLOCK_M=big", "BLOCK_M", "=3"):
        monkeypatch.setenv("DFLASH_FLEX_KERNEL_OPTIONS", bad)
        with pytest.raises(ValueError, match=f"DFLASH_FLEX_KERNEL_OPTIONS: '{bad}' is not KEY=INT"):
            settings.flex_kernel_options()
