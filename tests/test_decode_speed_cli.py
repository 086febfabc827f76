"""bench/gpu/decode_speed.py's CPU-side logic: --compile-scopes parsing (one clear error for an
unknown scope), --smoke's settings, and the per-piece --budget-s estimate."""
import time
from pathlib import Path

import pytest

from bench.gpu import decode_speed
from dflash.decode.compile_choices import COMPILE_SCOPES, DEFAULT_COMPILE_SCOPE

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ds():
    return decode_speed


def test_compile_scopes_parse_with_modes(ds):
    a = ds.parse(["--random", "--out", "x", "--compile-scopes",
                  "regions,fused:max-autotune-no-cudagraphs"])
    assert a.scopes == {"regions": ("regions", None),
                        "fused:max-autotune-no-cudagraphs": ("fused", "max-autotune-no-cudagraphs")}
    assert ds.parse(["--random", "--out", "x"]).scopes == {
        DEFAULT_COMPILE_SCOPE: (DEFAULT_COMPILE_SCOPE, None)}


def test_unknown_scope_is_one_clear_error(ds, capsys):
    with pytest.raises(SystemExit):
        ds.parse(["--random", "--out", "x", "--compile-scopes", "fused,graph"])
    assert "'graph' is not one of" in capsys.readouterr().err


def test_smoke_is_a_small_cpu_run_of_every_scope(ds):
    a = ds.parse(["--smoke", "--out", "x"])
    assert a.random and a.target_layers == 2 and a.max_new == 8
    assert list(a.scopes) == list(COMPILE_SCOPES)
    assert a.batches == "1,2" and a.compile_backend in ("aot_eager", None)


def test_budget_skips_a_piece_by_its_own_last_wall_time(ds):
    b = ds.Budget(100.0, time.time() - 50)                       # 50 s spent
    assert b.refuse("scope step") is None                        # never timed: it runs
    b.last["scope step"], b.last["scope fused"] = 40.0, 20.0
    why = b.refuse("scope step")                                 # 50 + 60 > 100
    assert why.startswith("budget: 50 s spent + 1.5 x 40 s (scope step at the last batch")
    assert "--budget-s 100" in why
    assert b.refuse("scope fused") is None                       # 50 + 30 <= 100
    assert ds.Budget(None, 0.0).refuse("scope step") is None     # no budget: never skipped


def test_adaptive_widths_parse_and_imply_adaptive(ds, capsys):
    a = ds.parse(["--random", "--out", "x", "--adaptive-widths", "4,8"])
    assert a.adaptive and a.widths == [4, 8]
    assert not ds.parse(["--random", "--out", "x"]).adaptive
    with pytest.raises(SystemExit):
        ds.parse(["--random", "--out", "x", "--adaptive-widths", "1"])
    assert "each width is at least 2" in capsys.readouterr().err


def test_adaptive_prints_the_choice_and_its_speedup(ds, capsys):
    """The H200's batch-64 figures as the pair records them: target-only chosen, speed-up 1.0
    although speculation measured 0.90."""
    a = ds.parse(["--random", "--out", "x", "--adaptive"])
    accept = [0.57, 0.28, 0.12, 0.05, 0.02, 0.006] + [0.0] * 9
    r = {"batch": 64, "compile_scope": next(iter(a.scopes)),
         "target_only_tokens_per_s": 20727.0, "speculative_tokens_per_s": 18711.0,
         "adaptive": {"candidates": [{"width": 0, "step_ms": 1.0}, {"width": 16, "step_ms": 1.77}],
                      "accept_rate_by_position": accept}}
    ds.adapt(a, None, None, [[1, 2]], r)
    assert r["choice"] == "target-only" and r["choice_speedup"] == 1.0
    assert r["adaptive"]["measured_tok_s"] == {"0": 20727.0, "16": 18711.0}
    assert "batch  64 [adaptive]: choice target-only, speed-up of the choice 1.000" in (
        capsys.readouterr().out)
