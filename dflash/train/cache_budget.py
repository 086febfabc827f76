"""What the target-feature cache stores and what that costs (:mod:`dflash.train.feature_cache`
is the store): its *planes* (one per per-token field of what the target hands the drafter: the
features, and with a distilling objective the soft labels' ids and log-probs), the bytes they
take, and the budget against free device memory, host memory or disk that ``dflash validate`` prints and the
train stage checks before heavy work (a cache that does not fit is refused with the figures).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.dataset import load_dataset
from ..errors import SpecError
from ..models.dtypes import dtype_of
from ..models.target import hf_config, layer_ids
from ..spec.types import cache_mode
from .objective import SOFT_KINDS

FP8 = torch.float8_e4m3fn
STORE_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3": FP8}


@dataclass(frozen=True)
class Plane:
    """One per-token tensor field of what the target hands the drafter."""
    name: str            # "features", "soft_ids", "soft_logprobs"
    width: int           # values per token
    dtype: torch.dtype   # the dtype the drafter gets
    store: torch.dtype   # the dtype stored (FP8: with ``groups`` float32 scales per token)
    groups: int = 1

    @property
    def bytes_per_token(self) -> int:
        scales = 4 * self.groups if self.store == FP8 else 0
        return self.width * self.store.itemsize + scales


def planes_for(spec, layers: int, hidden: int) -> list[Plane]:
    """The planes of ``spec``'s run: the features, and the soft labels when the objective
    distils (``loss.kind`` kd / ce+kd: top-k token ids and log-probs, stored per token)."""
    target = dtype_of(spec.target.dtype)
    store = STORE_DTYPES.get(spec.features.dtype, target)
    planes = [Plane("features", layers * hidden, target, store, groups=layers)]
    if spec.loss.kind in SOFT_KINDS:
        k = spec.loss.kd_top_k
        planes += [Plane("soft_ids", k, torch.int32, torch.int32),
                   Plane("soft_logprobs", k, torch.float32, torch.float32)]
    return planes


# ---------------------------------------------------------------------------------------------
# budget
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Budget:
    mode: str            # device | host | disk
    dtype: str           # features.dtype
    tokens: int
    samples: int
    bytes: int
    available: int       # usable after the headroom
    where: str           # "cuda:0 memory", "host memory" or the cache folder's file system
    upper_bound: bool = False  # tokens estimated from the spec (no dataset yet)

    @property
    def fits(self) -> bool:
        return self.bytes <= self.available

    def need(self) -> str:
        bound = "<= " if self.upper_bound else ""
        return (f"features.cache {self.mode} ({self.dtype}): {bound}{gb(self.bytes)} for "
                f"{bound}{self.tokens:,} tokens of {self.samples:,} samples")

    def describe(self) -> str:
        return f"{self.need()}; {gb(self.available)} usable in {self.where}"


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def cache_device(spec) -> str:
    """Where ``features.cache: device`` keeps the store: the one target worker's device (the
    spec check refuses the mode with more than one)."""
    return spec.topology.targets[0]


def available_bytes(mode: str, path: Path, device: str | None = None) -> int:
    """Free memory of ``device`` (``device`` mode on CUDA), free host memory (``MemAvailable``)
    or free space of the file system holding ``path``."""
    if mode == "device" and device is not None and torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    if mode == "disk":
        p = Path(path)
        while not p.exists():
            p = p.parent
        return shutil.disk_usage(p).free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_dir(train_dir: Path) -> Path:
    return Path(train_dir) / "feature_cache"


def store_bytes(spec, tokens: int, layers: int, hidden: int) -> int:
    """Bytes the cache of ``spec`` stores for ``tokens`` tokens (every plane, float8 scales
    included). The one formula: :func:`budget` uses it, and so can a run-wide budget (e.g. a
    ``dflash.train.budget`` item: disk for ``disk``, host memory for ``host``)."""
    return tokens * sum(p.bytes_per_token for p in planes_for(spec, layers, hidden))


def budget(spec, tokens: int, samples: int, train_dir: Path, layers: int, hidden: int,
           available: int | None = None, upper_bound: bool = False) -> Budget:
    """The storage the spec's cache needs against what this machine has (``available``: the
    free bytes, measured when not given), less ``features.headroom``."""
    mode = cache_mode(spec)
    need = store_bytes(spec, tokens, layers, hidden)
    dev = cache_device(spec) if mode == "device" else None
    free = available_bytes(mode, cache_dir(train_dir), dev) if available is None else available
    if mode == "disk":
        where = f"the file system of {cache_dir(train_dir)}"
    else:  # host, or a device store on the CPU (its memory is the host's)
        where = f"{dev} memory" if dev and dev.startswith("cuda") else "host memory"
    return Budget(mode, spec.features.dtype, tokens, samples, need,
                  int(free * (1 - spec.features.headroom)), where, upper_bound)


def check_budget(b: Budget, spec_path) -> None:
    """Refuse, before heavy work, a cache that does not fit (see the module docstring)."""
    if not b.fits:
        raise SpecError(f"{spec_path}: field 'features.cache': {b.describe()}: it does not "
                        f"fit. Use features.dtype float8_e4m3 (half of bfloat16), "
                        f"features.cache host or disk (device: the GPU's memory), fewer data.* "
                        f"samples, or features.cache off")


def spec_budget(spec, results: Path, available: int | None = None) -> Budget | None:
    """For ``dflash validate``: the budget from the dataset when the data stage has run, else
    an upper bound from the spec's data fields (None when the cache is off)."""
    if cache_mode(spec) == "off":
        return None
    cfg = hf_config(spec.target)
    layers, hidden = len(layer_ids(spec.target, cfg)), cfg.hidden_size
    tokens = samples = None
    try:
        ds = load_dataset(spec, results)
        tokens, samples = sum(ds.lengths), len(ds.lengths)
    except Exception:  # noqa: BLE001 - no (valid) dataset yet: estimate from the spec
        pass
    upper = tokens is None
    if upper:
        d = spec.data
        samples = d.max_prompts * d.samples_per_prompt
        tokens = samples * (d.max_prompt_tokens + d.max_new_tokens)
    return budget(spec, tokens, samples, results / "train", layers, hidden, available, upper)


def run_budget(spec, ds, train_dir: Path, cfg, available: int | None = None) -> Budget | None:
    """The budget of a run on dataset ``ds`` (None when the cache is off)."""
    if cache_mode(spec) == "off":
        return None
    return budget(spec, sum(ds.lengths), len(ds.lengths), train_dir, len(cfg.target_layer_ids),
                  cfg.hidden_size, available)


def check_run(spec, ds, train_dir: Path, cfg, log=print) -> Budget | None:
    """Say what the cache will take and refuse it, before heavy work, when it does not fit."""
    b = run_budget(spec, ds, train_dir, cfg)
    if b is not None:
        log(f"[train] {b.describe()}")
        check_budget(b, spec.path)
    return b
