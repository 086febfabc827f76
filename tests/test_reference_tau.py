"""bench/gpu/reference_tau.py's own pieces: the crop shim that lets the reference loop run on
transformers >= 5.18, and the τ comparison. Both loops side by side on a trained drafter:
tests/test_reference_agreement.py (against the vendored reference, tests/reference_zlab/)."""
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from bench.gpu import reference_tau
from dflash.decode.speculative import Decoded

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def rt():
    return reference_tau


def test_legacy_crop_keeps_the_first_n_positions(rt):
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
    ref = [{"tokens": [5, 6, 7, 8], "acceptance_lengths": [2, 1, 2, 1], "seconds": 0.1}]
    ours = [Decoded(tokens=[5, 6, 7, 8], target_forwards=3, tau=4 / 3, accept_counts=[],
                    block_lengths=[2, 1, 1], accepted=[1, 0, 1])]
    c = rt.compare(ref, ours, ours)
    row = c["per_prompt"][0]
    assert row["acceptance_prefix_equal"] and row["reference_equals_ours"]
    assert row["tau_reference"] == 1.5 and row["tau_ours"] == pytest.approx(5 / 3)
    assert row["tau_reference_same_steps"] == pytest.approx(5 / 3)
    assert c["prompts_same_acceptance"] == 1
