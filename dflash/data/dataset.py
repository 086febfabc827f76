"""The dataset the data stage made (``results/<spec>/data/dataset.parquet``), as training reads it:
verified against its manifest (same spec fields and target, same sha256) before any row is read."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from ..artifacts.manifest import expect, read_manifest, verify_files
from ..models.target import target_fingerprint

DATASET = "dataset.parquet"


class TokenDataset:
    """The verified dataset: ``lengths[i]`` and ``sample(i) -> (sample_id, input_ids, loss_mask)``."""

    def __init__(self, table, manifest: dict):
        self.manifest = manifest
        self.sample_ids: list[int] = table["sample_id"].to_pylist()
        self.input_ids: list[list[int]] = table["input_ids"].to_pylist()
        self.loss_mask: list[list[int]] = table["loss_mask"].to_pylist()
        self.lengths = [len(x) for x in self.input_ids]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample(self, i: int) -> tuple[int, list[int], list[int]]:
        return self.sample_ids[i], self.input_ids[i], self.loss_mask[i]


def load_dataset(spec, results_dir: Path) -> TokenDataset:
    """Read ``results_dir/data``, refusing a stale (other spec/target) or modified dataset."""
    data_dir = Path(results_dir) / "data"
    mpath = data_dir / "manifest.json"
    manifest = read_manifest(mpath, "data")
    expect(manifest, mpath, {"data": spec.fingerprint("data"),
                             "target": target_fingerprint(spec.target)})
    # the dataset by content (a damaged one sets the manifest aside: Snakemake reruns data,
    # which rebuilds it from its verified shards)
    path = data_dir / manifest["dataset"]["path"]
    verify_files({"files": {manifest["dataset"]["path"]: manifest["dataset"]["sha256"]}},
                 mpath, "data")
    return TokenDataset(pq.read_table(path), manifest)
