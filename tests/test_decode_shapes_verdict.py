"""bench/decode_shapes_verdict.py: the rule that makes `dynamic` the decoders' default shapes
(less compiling, steps on the whole no slower, no one step much slower), its one-line errors,
and the committed CPU verdict being what the committed runs give."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.decode_shapes_verdict import main, rows_by_batch, verdict
from bench.entry import run
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]
CPU = REPO / "bench" / "results" / "cpu" / "decode_shapes"


def run_doc(shapes, per_batch):
    """A decode_speed result: batch -> ((target-only compile s, ms), (speculative ...))."""
    return {"compile_shapes": shapes, "batches": [
        {"batch": b, "engine": {e: {"compile_seconds": c, "ms_per_step": ms}
                                for e, (c, ms) in zip(("target_only", "speculative"), v)}}
        for b, v in per_batch.items()]}


def judged(static, dynamic):
    return verdict(rows_by_batch(run_doc("static", static), Path("s.json"), "static"),
                   rows_by_batch(run_doc("dynamic", dynamic), Path("d.json"), "dynamic"))


STATIC = {4: ((5.0, 2.0), (20.0, 4.0)), 16: ((5.0, 3.0), (20.0, 6.0)), 64: ((7.0, 5.0), (21.0, 9.0))}


def test_less_compiling_and_steps_as_fast_make_dynamic_the_default():
    v = judged(STATIC, {4: ((7.0, 2.02), (30.0, 4.0)), 16: ((0.1, 2.97), (0.1, 6.05)),
                        64: ((0.1, 5.0), (0.1, 9.1))})
    assert v["default"] == "dynamic", v["why"]
    assert v["compile_s"] == {"static": 78.0, "dynamic": 37.4}
    assert v["step_ratio_geomean"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("dynamic,reason", [
    # one engine at one batch size 6 % slower: named
    ({4: ((7.0, 2.0), (30.0, 4.0)), 16: ((0.1, 3.0), (0.1, 6.36)), 64: ((0.1, 5.0), (0.1, 9.0))},
     "batch 16 speculative 1.060x"),
    # every step 3 % slower: slower on the whole, though none by 5 %
    ({b: ((0.1, t[1] * 1.03), (0.1, s[1] * 1.03)) for b, (t, s) in STATIC.items()},
     "1.030x on the whole"),
    # as fast, but no less compiling
    ({b: ((t[0], t[1]), (s[0] + 1, s[1])) for b, (t, s) in STATIC.items()},
     "does not compile in less time"),
])
def test_the_rule_keeps_static_and_says_why(dynamic, reason):
    v = judged(STATIC, dynamic)
    assert v["default"] == "static" and reason in v["why"], v["why"]


def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys):
    s, d = tmp_path / "static.json", tmp_path / "dynamic.json"
    s.write_text(json.dumps(run_doc("static", STATIC)))
    d.write_text(json.dumps(run_doc("static", STATIC)))          # the static run twice
    with pytest.raises(SystemExit) as e:
        run(lambda: main([str(s), str(d)]))
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {d}: a run with compile_shapes 'static'") and "\n" not in err
    d.write_text('{"compile_shapes": "dynamic", "batches": [{"batch": 4}]}')
    with pytest.raises(DFlashError, match=f"{d}: not a bench.gpu.decode_speed result"):
        main([str(s), str(d)])


def test_the_committed_cpu_verdict_is_what_its_runs_give(tmp_path):
    out = tmp_path / "verdict.json"
    main([str(CPU / "static.json"), str(CPU / "dynamic.json"), "--out", str(out)])
    got, kept = json.loads(out.read_text()), json.loads((CPU / "verdict.json").read_text())
    assert {k: v for k, v in got.items() if k not in ("static", "dynamic")} == \
        {k: v for k, v in kept.items() if k not in ("static", "dynamic")}
