"""The data stage's plan on disk: samples in fixed chunks, one shard per chunk.

A chunk is ``data.gen_batch_size`` samples of similar prompt length (little left padding), and
its answers are written as one shard, ``shards/part-<chunk>.parquet`` (checksummed,
:mod:`dflash.data.shards`). A restarted run keeps the shards made from exactly the same inputs
(the ``meta.json`` beside them) and whose bytes and sample ids still match, so only the missing
chunks are generated; the merge checks every shard by content again and that every sample is
there exactly once.

Owns: :func:`make_chunks`, the rows schema and table, :func:`shard_path`, :func:`keep_shards`
(the resume check), :func:`write_chunk` and :func:`merge_shards`. Imports the top-level modules,
:mod:`dflash.data.shards` and :mod:`dflash.data.sources` (``Sample``, the stage's ``log``).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import DFlashError
from ..artifacts.manifest import atomic_write_json, rerun_command
from . import shards
from .sources import Sample, log

SHARDS = "shards"
SHARD_META = "meta.json"


def make_chunks(samples: Sequence[Sample], chunk_size: int) -> list[list[Sample]]:
    """Fixed chunks: similar prompt lengths together (little left padding), ties by sample_id."""
    order = sorted(samples, key=lambda s: (len(s.prompt_ids), s.sample_id))
    return [order[i:i + chunk_size] for i in range(0, len(order), chunk_size)]


def rows_schema():
    return pa.schema([("sample_id", pa.int64()), ("prompt_id", pa.int64()),
                      ("sample_index", pa.int32()), ("input_ids", pa.list_(pa.int32())),
                      ("loss_mask", pa.list_(pa.int8())), ("num_prompt_tokens", pa.int32()),
                      ("num_response_tokens", pa.int32()), ("stopped_at_eos", pa.bool_())])


def rows_table(samples: Sequence[Sample], responses: Sequence[Sequence[int]], eos_ids):
    cols: dict[str, list] = {f.name: [] for f in rows_schema()}
    for s, r in sorted(zip(samples, responses), key=lambda x: x[0].sample_id):
        cols["sample_id"].append(s.sample_id)
        cols["prompt_id"].append(s.prompt_id)
        cols["sample_index"].append(s.sample_index)
        cols["input_ids"].append(list(s.prompt_ids) + list(r))
        cols["loss_mask"].append([0] * len(s.prompt_ids) + [1] * len(r))
        cols["num_prompt_tokens"].append(len(s.prompt_ids))
        cols["num_response_tokens"].append(len(r))
        cols["stopped_at_eos"].append(bool(r) and r[-1] in eos_ids)
    return pa.Table.from_pydict(cols, schema=rows_schema())


def shard_path(shard_dir: Path, chunk: int) -> Path:
    return shard_dir / f"part-{chunk:05d}.parquet"


def keep_shards(shard_dir: Path, meta: dict, chunks: list[list[Sample]]) -> set[int]:
    """Keep shards made from exactly these inputs; return the sample ids they already hold."""
    meta_path = shard_dir / SHARD_META
    existing = sorted(shard_dir.glob("part-*.parquet")) if shard_dir.is_dir() else []
    old = None
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            old = None
    if existing and old != meta:
        why = "no shard record" if old is None else ", ".join(
            (f"made by other code: the data stage's code changed ({old.get(k)} -> {v}); "
             f"generating them again" if k == "code" else f"{k} {old.get(k)!r} -> {v!r}")
            for k, v in meta.items() if old.get(k) != v)
        log(f"discarding {len(existing)} shard(s) made from other inputs ({why})")
        shutil.rmtree(shard_dir)
        existing = []
    shard_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(meta_path, meta)
    for tmp in shard_dir.glob(".part-*.tmp"):  # leftovers of a killed atomic write
        tmp.unlink(missing_ok=True)
    done: set[int] = set()
    for path in existing:
        try:
            chunk = int(path.stem.split("-")[1])
            shards.verify_shard(path)  # every column, by content
            ids = pq.read_table(path, columns=["sample_id"])["sample_id"].to_pylist()
            want = sorted(s.sample_id for s in chunks[chunk])
            if sorted(ids) != want:  # a chunk is regenerated whole, as one batch
                raise ValueError(f"does not hold exactly the samples of chunk {chunk}")
        except Exception as e:  # unreadable / foreign shard: regenerate it
            log(f"discarding shard {path.name} ({e}); regenerating it")
            shards.remove_shard(path)
            continue
        done.update(ids)
    return done


def write_chunk(shard_dir: Path, chunk: int, samples, responses, eos: set) -> Path:
    path = shard_path(shard_dir, chunk)
    shards.write_shard(path, rows_table(samples, responses, eos))  # checksummed, every column
    return path


def merge_shards(shard_dir: Path, chunks, samples):
    paths = [shard_path(shard_dir, i) for i in range(len(chunks))
             if shard_path(shard_dir, i).is_file()]
    for p in paths:  # by content again: a shard damaged since the resume check is not merged
        try:
            shards.verify_shard(p)
        except ValueError as e:
            shards.remove_shard(p)
            raise DFlashError(f"{p}: {e}; removed it: rerun the same snakemake command "
                              f"(`snakemake --cores all bench_{p.parents[2].name}`) and the "
                              f"data stage generates it again") from None
    tables = [pq.read_table(p, schema=rows_schema()) for p in paths]
    table = pa.concat_tables(tables).sort_by("sample_id").combine_chunks()
    got = table["sample_id"].to_pylist()
    want = sorted(s.sample_id for s in samples)
    if got != want:
        missing = sorted(set(want) - set(got))[:10]
        dup = sorted({x for x in got if got.count(x) > 1})[:10]
        raise DFlashError(f"{shard_dir}: shards do not hold every sample exactly once "
                          f"(missing {missing}, duplicated {dup}); delete the folder and "
                          f"rerun the data stage: `{rerun_command('data', shard_dir)}`")
    return table
