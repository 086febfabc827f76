"""bench/gpu/reference_tau.py's own pieces (the reference code itself is not in this repository:
the script runs against a checkout, bench/results/reference_tau_cpu.json): the crop shim that
lets the reference loop run on transformers >= 5.18, and the τ comparison."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from dflash.decode.speculative import Decoded

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rt():
    sys.path.insert(0, str(REPO / "bench" / "gpu"))
    spec = importlib.util.spec_from_file_location("reference_tau",
                                                  REPO / "bench" / "gpu" / "reference_tau.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_legacy_crop_keeps_the_first_n_positions(rt):
    pass

    cache = DynamicCache()
    k = torch.arange(8.0).view(1, 1, 8, 1)
    cache.update(k, k.clone(), 0)
    legacy = rt._legacy_crop(Cache.crop)
    legacy(cache, 10)                        # longer than the cache: nothing to do
    assert cache.get_seq_length() == 8
    legacy(cache, 5)                         # the reference's crop(start): keep positions < 5
    assert cache.get_seq_length() == 5
    assert cache.layers[0].keys.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    legacy(cache, -2)                        # the new meaning passes through: drop 2
    assert cache.get_seq_length() == 3


def test_compare_counts_steps_and_streams(rt):
    pass

    ref = [{"tokens": [5, 6, 7, 8], "acceptance_lengths": [2, 1, 2, 1], "seconds": 0.1}]
    ours = [Decoded(tokens=[5, 6, 7, 8], target_forwards=3, tau=4 / 3, accept_counts=[],
                    block_lengths=[2, 1, 1], accepted=[1, 0, 1])]
    c = rt.compare(ref, ours, ours)
    row = c["per_prompt"][0]
    assert row["acceptance_prefix_equal"] and row["reference_equals_ours"]
    assert row["tau_reference"] == 1.5 and row["tau_ours"] == pytest.approx(5 / 3)
    assert row["tau_reference_same_steps"] == pytest.approx(5 / 3)
    assert c["prompts_same_acceptance"] == 1
