"""bench/speedup_table.py: our speed-up rows come from the committed decode_speed JSON, spliced
between markers (never hand-copied); a stale table is detected; bad input is one clear error."""
import json
from pathlib import Path

import pytest

from bench import speedup_table
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]
RANDOM = REPO / "bench" / "results" / "h200" / "decode_speed_random.json"


@pytest.fixture(scope="module")
def st():
    return speedup_table


def test_rows_carry_the_json_figures(st):
    d = json.loads(RANDOM.read_text())
    rows = st.rows(RANDOM)
    assert len(rows) == len(d["batches"])
    b1 = d["batches"][0]
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[0] == str(b1["batch"])
    assert cells[2] == f"{b1['target_only_tokens_per_s']:,.1f}"
    assert cells[3] == f"{b1['speculative_tokens_per_s']:,.1f}"
    assert cells[5] == f"**{b1['speedup']:.2f}×**"
    assert cells[6] == b1.get("choice", "n/a")
    assert cells[8] == f"{b1['hf_static']['tokens_per_s']:,.1f}"


def test_rows_carry_the_choice_and_its_measured_speedup(st, tmp_path):
    d = json.loads(RANDOM.read_text())
    d["batches"][0].update(choice="target-only", choice_speedup=0.987)
    p = tmp_path / "decode_speed.json"
    p.write_text(json.dumps(d))
    cells = [c.strip() for c in st.rows(p)[0].strip("|").split("|")]
    assert cells[6:8] == ["target-only", "0.99×"]


def test_write_then_check_and_stale_detection(st, tmp_path):
    md = tmp_path / "README.md"
    md.write_text(f"intro\n{st.BEGIN}\n| TBD (H200 run) |\n{st.END}\noutro\n")
    assert st.main(["--json", str(RANDOM), "--check", str(md)]) == 1      # placeholder: stale
    assert st.main(["--json", str(RANDOM), "--write", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "TBD" not in text
    assert st.main(["--json", str(RANDOM), "--check", str(md)]) == 0
    md.write_text(text.replace("435.8", "999.9"))                        # a hand edit
    assert st.main(["--json", str(RANDOM), "--check", str(md)]) == 1


def test_bad_input_is_one_clear_error(st, tmp_path):
    bad = tmp_path / "decode_speed.json"
    bad.write_text("{}")
    with pytest.raises(DFlashError, match="decode_speed.json: not a decode_speed.json"):
        st.rows(bad)
    md = tmp_path / "x.md"
    md.write_text("no markers")
    with pytest.raises(DFlashError, match="x.md: needs exactly one"):
        st.splice(md.read_text(), "t", str(md))


def test_a_skipped_batch_size_is_a_row_not_a_gap(st, tmp_path):
    d = json.loads(RANDOM.read_text())
    d["skipped"] = [{"batch": 64, "reason": "budget: 400 s spent"}]
    p = tmp_path / "decode_speed.json"
    p.write_text(json.dumps(d))
    last = st.rows(p)[-1]
    assert last.startswith("| 64 |") and "not measured: budget: 400 s spent" in last


def test_several_verify_widths_show_beside_the_full_block(st, tmp_path):
    """A sweep with bench.decode_widths: each width's speed-up in the verify-tokens cell, the
    chosen width in the choice; the committed round-8 JSON (one width) renders as before."""
    round8 = REPO / "bench" / "results" / "h200" / "round8-2026-12-02" / "decode_sweep.json"
    assert [c.strip() for c in st.rows(round8)[0].strip("|").split("|")][1] == "16"
    d = json.loads(RANDOM.read_text())
    d["batches"][0].update(widths=[{"width": 4, "speedup": 1.314}, {"width": 16, "speedup": 1.2}],
                           choice="speculative (verify 4)")
    p = tmp_path / "decode_speed.json"
    p.write_text(json.dumps(d))
    cells = [c.strip() for c in st.rows(p)[0].strip("|").split("|")]
    assert cells[1] == f"{d.get('verify_tokens', 'n/a')} (4: 1.31×, 16: 1.20×)"
    assert cells[6] == "speculative (verify 4)"
