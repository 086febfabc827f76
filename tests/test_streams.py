"""The target worker's own-stream switch (dflash.train.streams): which devices get a stream,
and which tensors the drafter's stream claims. The stream itself is CUDA's: on CPU the switch
must change nothing, which the scheduler tests then cover bit for bit."""
from __future__ import annotations

import pytest
import torch

from dflash import settings
from dflash.models.target_output import SoftLabels, TargetOutput
from dflash.train.streams import TargetStream, consume, tensors_of


def test_the_switch_parses_or_names_itself(monkeypatch):
    monkeypatch.delenv("DFLASH_TARGET_STREAM", raising=False)
    assert settings.target_stream() == "shared"
    monkeypatch.setenv("DFLASH_TARGET_STREAM", " Own ")
    assert settings.target_stream() == "own"
    monkeypatch.setenv("DFLASH_TARGET_STREAM", "mine")
    with pytest.raises(ValueError, match="DFLASH_TARGET_STREAM: 'mine'"):
        settings.target_stream()


def test_no_stream_off_cuda_or_when_switched_off(monkeypatch):
    """CPU workers (and the default switch) keep the default stream: no event, no wait."""
    for value in ("own", "shared"):
        monkeypatch.setenv("DFLASH_TARGET_STREAM", value)
        s = TargetStream("cpu", ["cpu"])
        s.enter()
        assert s.stream is None and s.ready() is None
    consume(torch.zeros(2), None, "cpu")  # nothing to wait for: a no-op


def test_tensors_of_finds_features_and_soft_labels():
    feats = torch.zeros(1, 4, 6)
    soft = SoftLabels(torch.arange(3), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))
    found = list(tensors_of(TargetOutput(feats, soft)))
    assert [t.data_ptr() for t in found] == [feats.data_ptr(), soft.positions.data_ptr(),
                                             soft.token_ids.data_ptr(), soft.logprobs.data_ptr()]
    assert list(tensors_of(TargetOutput(feats))) == [feats]
    assert [t.shape for t in tensors_of({"a": (feats, [soft.positions]), "b": None})] == [
        feats.shape, soft.positions.shape]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_own_stream_only_for_a_device_a_drafter_shares(monkeypatch):
    monkeypatch.setenv("DFLASH_TARGET_STREAM", "own")
    assert TargetStream("cuda:0", ["cuda:0"]).stream is not None
    assert TargetStream("cuda:0", ["cpu"]).stream is None
