"""bench/self_written_lengths.py: the share of self-written turns that end by each cap and what
they cost, from the data stage's own prefixes, seeds and engine (the real SmolLM2 on the CPU)."""
import json

import pytest

from bench import self_written_lengths as swl


def test_caps_count_ended_turns_and_the_tokens_spent():
    rows = [("a", 10, True), ("a", 100, False), ("b", 50, True), ("b", 80, True)]
    pooled = swl.at_caps(rows, 100)
    assert [r["cap"] for r in pooled] == [64, 96]          # caps above the draw's length: none
    assert pooled[0] == {"cap": 64, "ended_share": 0.5, "tokens_per_candidate": 47.0,
                         "tokens_per_ended_turn": 94.0}    # (10 + 64 + 50 + 64) / 4, / 2
    assert pooled[1]["ended_share"] == 0.75 and pooled[1]["tokens_per_candidate"] == 59.0
    s = swl.summarise(rows, 100)
    assert s["never_ended"] == {"a": 1}
    assert s["by_category"]["a"][1]["ended_share"] == 0.5
    assert s["ended_length_percentiles"] == {50: 50, 90: 80, 99: 80}


def test_a_real_draw_of_the_quality_specs_candidates(tmp_path):
    out = tmp_path / "lengths.json"
    assert swl.main(["--spec", "specs/smollm2-quality.yaml", "--per-category", "1",
                     "--max-tokens", "64", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["by_category"]) == {"writing", "roleplay", "reasoning", "math", "coding",
                                       "extraction", "stem", "humanities"}
    [at64] = res["pooled"]
    # every candidate either ended within the 64 tokens drawn or is counted as never ended
    assert round(at64["ended_share"] * 8) == 8 - sum(res["never_ended"].values())
    assert res["command"].startswith("python -m bench.self_written_lengths --spec")


def test_a_spec_without_category_cues_is_one_clear_error(capsys):
    """specs/tiny.yaml's self-written prompts (if any) are unsteered: nothing to draw under."""
    with pytest.raises(SystemExit) as e:
        swl.run(lambda: swl.main(["--spec", "specs/tiny.yaml", "--out", "/dev/null"]))
    assert e.value.code != 0
    assert "data.self_written.categories is empty" in capsys.readouterr().err
