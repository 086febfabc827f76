"""The adaptive choice (dflash/decode/adaptive.py) on the H200 figures of issue #36: SmolLM2-135M
target, 5-layer drafter, τ ≈ 2.0; spec/target step ratio 1.27 at batch 1, 1.77 at batch 64."""
import pytest

from dflash.decode.adaptive import choose, expected_tokens, wave_tokens
from dflash.errors import DFlashError

ACCEPT = [0.57, 0.28, 0.12, 0.05, 0.02, 0.006] + [0.0] * 9     # cumulative, 15 drafts


def test_expected_tokens_is_one_plus_the_first_shares():
    assert expected_tokens(ACCEPT, 0) == expected_tokens(ACCEPT, 1) == 1.0
    assert expected_tokens(ACCEPT, 3) == pytest.approx(1.85)
    assert expected_tokens(ACCEPT, 16) == pytest.approx(2.046)
    assert wave_tokens(ACCEPT, 16, 1) == pytest.approx(2.046)      # one sequence: the mean


def test_batch_1_speculates():
    r = choose(1, {0: 1.0, 16: 1.27}, ACCEPT)
    assert r["choice"] == 16 and r["expected_gain"] == pytest.approx(2.046 / 1.27)
    assert [c["width"] for c in r["candidates"]] == [0, 16] and "1.61×" in r["why"]
    # a cheaper narrow verify that keeps most of τ wins over the whole block
    assert choose(1, {0: 1.0, 3: 1.05, 16: 1.27}, ACCEPT)["choice"] == 3


def test_batch_64_falls_back_to_target_only():
    """The mean alone says 2.046 / 1.77 = 1.16× (> 1.1: it would speculate; 0.90× was
    measured); the slowest of 64 sequences makes the wave's tokens per step ≈ 1.77: ~1.0×."""
    assert expected_tokens(ACCEPT, 16) / 1.77 > 1.1
    r = choose(64, {0: 1.0, 16: 1.77}, ACCEPT)
    assert r["choice"] == 0 and r["expected_gain"] == pytest.approx(1.0, abs=0.03)
    assert "target-only" in r["why"]
    assert wave_tokens(ACCEPT, 16, 64) < wave_tokens(ACCEPT, 16, 4) < wave_tokens(ACCEPT, 16, 1)


def test_the_margin_is_a_strict_boundary():
    at = 2.046 / 1.1                           # exactly 1 + margin: not enough
    assert choose(1, {0: 1.0, 16: at * 1.001}, ACCEPT)["choice"] == 0
    assert choose(1, {0: 1.0, 16: at * 0.999}, ACCEPT)["choice"] == 16
    assert choose(1, {0: 1.0, 16: at * 0.999}, ACCEPT, margin=0.2)["choice"] == 0


def test_no_target_only_time_is_one_clear_error():
    with pytest.raises(DFlashError, match="target-only"):
        choose(4, {16: 1.3}, ACCEPT)
    assert choose(4, {0: 1.0}, ACCEPT)["choice"] == 0


def test_a_decoded_wave_s_tokens_per_step_replace_the_model():
    """Round 7 on the H200, batch 16 (the committed report's figures): the wave model promised
    1.93 tokens a step and 1.20x; the decoded wave realized 1.34 for speculation and 0.90 for
    target-only (sequences that end early idle in their wave) at all-in 2.822 and 1.755 ms a
    step: 0.95x, so target-only. Where a width has no decoded wave the model still decides."""
    step_ms = {0: 1.755, 16: 2.822}
    modelled = choose(16, step_ms, ACCEPT)
    assert {c["source"] for c in modelled["candidates"]} == {"wave model"}
    r = choose(16, step_ms, ACCEPT, tokens_per_step={0: 0.9026, 16: 1.3434})
    assert [c["source"] for c in r["candidates"]] == ["decoded wave", "decoded wave"]
    assert r["choice"] == 0 and r["expected_gain"] == pytest.approx(
        (1.3434 / 2.822) / (0.9026 / 1.755))
    part = choose(16, step_ms, ACCEPT, tokens_per_step={16: 1.3434})
    assert [c["source"] for c in part["candidates"]] == ["wave model", "decoded wave"]


def test_several_widths_the_best_one_is_chosen():
    """Batch 16 at round 8's figures: the full block (16) loses to target-only, but a
    narrower verify with a cheaper step still pays; the choice is the best of all widths."""
    step_ms = {0: 1.82, 4: 2.0, 8: 2.3, 16: 2.67}
    tps = {0: 0.95, 4: 1.45, 8: 1.5, 16: 1.52}
    r = choose(16, step_ms, ACCEPT, tokens_per_step=tps)
    assert [c["width"] for c in r["candidates"]] == [0, 4, 8, 16]
    best = max((w for w in step_ms if w), key=lambda w: tps[w] / step_ms[w])
    assert best == 4 and r["choice"] == 4 and "width 4" in r["why"]
    assert choose(16, {0: 1.82, 16: 2.67}, ACCEPT, tokens_per_step=tps)["choice"] == 0
