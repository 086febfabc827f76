"""Upstream stages shared by content: one copy of an env, warm-up or data stage per fingerprint.

Specs (sweep arms above all) whose env, warm-up or data inputs are identical get ONE job of that
stage: it writes ``results/.shared/<stage>-<key>/<stage>/`` (a dot cannot start a spec name, so the
store never collides with one), where ``key`` is :func:`share_key` of exactly what the rule's
params carry (the stage's spec fields, its code fingerprint, the lock or the env it ran in). Each
spec's own ``results/<spec>/<stage>/`` is then a folder of hard links to the store's files
(:func:`link_stage`), so every stage reads its inputs where it always did, and:

* deleting ``results/<spec>/`` removes that spec's links only: the store and every other spec's
  links keep the data (a file lives while one name links to it);
* rewriting the store (a stage rerun writes new files atomically, i.e. new inodes) never changes
  what a spec already linked; the link job reruns when the store's manifest checksum changes,
  and what depends on it reruns as before.

Hard links need one filesystem for ``results/``; where the OS refuses one, the file is copied.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import StaleArtifact
from .manifest import fingerprint, sha256_file

STORE = ".shared"
SHARED_STAGES = ("env", "warmup", "data")


def share_key(stage: str, fields: dict, code: str, upstream: dict) -> str:
    """The store key of a stage: its spec fields (Spec.section), its code fingerprint and what
    it was made from (env: the lock's sha256; warm-up and data: the env's key)."""
    return fingerprint({"stage": stage, "fields": fields, "code": code, "upstream": upstream})


def store_root(results: str | Path, stage: str, key: str) -> Path:
    """The results folder of a store entry: it holds ``<stage>/`` as results/<spec>/ would."""
    return Path(results) / STORE / f"{stage}-{key}"


def lock_digest(spec, repo: str | Path) -> str:
    """What the env key is made from: the sha256 of the spec's lock (``env.lock``, relative to
    the workflow folder ``repo``), or a stand-in naming the missing file."""
    lock = Path(repo, spec.env.lock)
    return sha256_file(lock) if lock.exists() else f"missing:{lock}"


def spec_keys(spec, code: dict[str, str], lock: str) -> dict[str, str]:
    """{stage: store key} of one spec's shared stages (:func:`share_key`): env from the lock,
    warm-up and data from env's key. The devices too: a shared job runs the stage with one of its
    specs' files, and every stage checks that spec's devices (an 8-GPU spec must not stand in for
    a 1-GPU one). ``code``: {stage: code fingerprint}. The DAG names its entries with this
    (rules/common_share.smk), and a stage finds the specs sharing its entry with it
    (:mod:`dflash.spec.sharers`)."""
    keys: dict[str, str] = {}
    devices = sorted(set(spec.devices()))
    for st in SHARED_STAGES:
        up = {"lock": lock} if st == "env" else {"env": keys["env"]}
        keys[st] = share_key(st, spec.section(st), code[st], {**up, "devices": devices})
    return keys


def entry_key(at: str | Path, stage: str) -> str | None:
    """The key of the store entry ``at`` (``<results>/.shared/<stage>-<key>``), None where ``at``
    is a spec's own folder (a stage run by hand)."""
    p = Path(at)
    prefix = f"{stage}-"
    return p.name[len(prefix):] if p.parent.name == STORE and p.name.startswith(prefix) else None


def link_file(src: Path, dst: Path) -> None:
    """``dst`` becomes a hard link to ``src`` (a copy where links are refused), atomically."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".link", dir=dst.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        try:
            os.link(src, tmp)
        except OSError:  # another filesystem, or links not allowed: a copy keeps it working
            shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def link_tree(src: Path, dst: Path) -> int:
    """Make ``dst`` a fresh folder of hard links mirroring ``src`` (built beside it, then swapped
    in; the old folder's names are unlinked, which never touches the store). Returns the count."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".new", dir=dst.parent))
    n = 0
    try:
        for f in sorted(p for p in src.rglob("*") if p.is_file()):
            link_file(f, tmp / f.relative_to(src))
            n += 1
        old = None
        if dst.exists() or dst.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
            os.replace(dst, old / "x")
        os.replace(tmp, dst)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return n


def link_stage(store: Path, stage: str, spec_results: Path,
               extras: tuple[tuple[Path, Path], ...] = ()) -> int:
    """``spec_results/<stage>/`` = links to ``store/<stage>/``; also each (src, dst) in
    ``extras`` that exists (the stage's log and Snakemake benchmark, under the spec's names)."""
    src = store / stage
    if not (src / "manifest.json").is_file():
        raise StaleArtifact(f"{src / 'manifest.json'}: the shared {stage} stage has no manifest; "
                            f"rerun it (snakemake reruns it when asked for the spec)")
    n = link_tree(src, Path(spec_results) / stage)
    for s, d in extras:
        if Path(s).is_file():
            link_file(Path(s), Path(d))
    return n


def main(argv: list[str]) -> int:
    """``dflash link <store entry> <stage> <results/<spec>> [--also SRC DST]...``: the
    link_stage job of rules/share.smk (SRC DST: the entry's log and benchmark, under the spec's
    names; a missing SRC is skipped, a missing log is replaced by a line saying where it went)."""
    ap = argparse.ArgumentParser(prog="dflash link", description=main.__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("stage", choices=SHARED_STAGES)
    ap.add_argument("spec_results")
    ap.add_argument("--log", help="the spec's log of the stage: a link to the entry's")
    ap.add_argument("--also", nargs=2, action="append", default=[], metavar=("SRC", "DST"))
    a = ap.parse_args(argv)
    store = Path(a.store)
    extras = tuple((Path(s), Path(d)) for s, d in a.also)
    n = link_stage(store, a.stage, Path(a.spec_results), extras)
    if a.log and not Path(a.log).is_file():
        Path(a.log).parent.mkdir(parents=True, exist_ok=True)
        Path(a.log).write_text(f"linked from {store} (its log is gone)\n")
    print(f"[link] {a.spec_results}/{a.stage}: {n} files linked from {store}", flush=True)
    return 0
