"""The README's figures come from committed files that still match the code: each quoted figure
cites FILE#KEY (bench/readme_figures.py), the cited value rounds to the quoted one, the figure
sections quote no speed-up or throughput without a citation, and the files derived from a run's
raw output (metrics.jsonl, the DAG log) are what the scripts make from it today."""
import json

import pytest

from bench import figures_from_log, readme_figures, steady_state_from_metrics
from bench.metrics_file import read_metrics
from dflash.errors import DFlashError
from dflash.runtime.harness import REPO

H200 = REPO / "bench" / "results" / "h200"
H100 = REPO / "bench" / "results" / "h100"
HEAD = "Run 2 (this round's code):"


def test_every_readme_figure_matches_the_file_it_cites():
    assert readme_figures.problems(REPO / "README.md") == []
    cited = readme_figures.citations((REPO / "README.md").read_text())
    assert len(cited) >= 80
    files = {c["path"] for c in cited}
    assert "bench/results/h200/smollm2-quality-run2/steady_state.json" in files
    assert all((REPO / f).is_file() for f in files)


def test_the_benchmarks_doc_figures_match_the_files_they_cite():
    docs = REPO / "docs" / "benchmarks.md"
    assert readme_figures.problems(docs) == []
    assert len(readme_figures.citations(docs.read_text())) >= 10


def test_a_wrong_or_uncited_figure_is_named(tmp_path):
    ss = "bench/results/h200/smollm2-quality-run2/steady_state.json"
    md = tmp_path / "README.md"
    md.write_text(f"{HEAD} **97.4K tokens/s**<!-- fig: {ss}#tokens_per_s --> and 1.36× over\n"
                  f"target-only; 97.3K<!-- fig: {ss}#tokens_per_s --> is right.\n")
    bad = readme_figures.problems(md)
    assert bad == [f"README.md:1: quoted 97.4K but {ss}#tokens_per_s = 97318.9",
                   "README.md:1: '1.36×' has no <!-- fig: FILE#KEY --> citation"]


def test_rounding_suffixes_and_ratios():
    ds = "bench/results/h200/decode_speed.json"
    b = json.loads((REPO / ds).read_text())["batches"][0]
    ratio = b["target_only_tokens_per_s"] / b["hf_static"]["tokens_per_s"]
    text = (f"{HEAD} 1.43×<!-- fig: {ds}#batches.0.target_only_tokens_per_s/"
            f"batches.0.hf_static.tokens_per_s --> and 0.47K<!-- fig: {ds}#batches.0."
            f"target_only_tokens_per_s --> and 1.4<!-- fig: {ds}#batches.0.target_only_"
            f"tokens_per_s/batches.0.hf_static.tokens_per_s -->")
    got = readme_figures.citations(text)
    assert [c["ok"] for c in got] == [True, True, True]
    assert got[0]["value"] == pytest.approx(ratio) and round(ratio, 2) == 1.43


def test_a_missing_file_or_key_is_one_clear_error():
    with pytest.raises(DFlashError, match="nope.json: not a readable JSON"):
        readme_figures.citations("1.0<!-- fig: bench/results/nope.json#a -->")
    with pytest.raises(DFlashError, match="decode_speed.json#batches.9.speedup: no key '9'"):
        readme_figures.citations("1.0<!-- fig: bench/results/h200/decode_speed.json#batches.9.speedup -->")


@pytest.mark.parametrize("run,metrics,budget", [
    ("smollm2-quality-run1", "metrics.jsonl", 8192),
    ("smollm2-quality-run2", "metrics.jsonl", 8192),
    ("qwen3-8b-2gpu-balanced", "qwen3-8b-2gpu-balanced__train__metrics.jsonl", 16384)])
def test_the_steady_state_files_are_what_the_script_makes_of_the_metrics(run, metrics, budget):
    rows = read_metrics(H200 / run / metrics)   # or its .gz
    committed = json.loads((H200 / run / "steady_state.json").read_text())
    assert steady_state_from_metrics.steady_state(rows, 5, budget) == committed


R25 = REPO / "bench" / "results" / "h100" / "round25-2026-12-06"


@pytest.mark.parametrize("metrics,committed", [
    ("h100/round25-2026-12-06/lease/r/smollm2-recipe-kd-epochs8__train__metrics.jsonl.gz",
     "kd_epochs8_first1315_steady_state.json"),
    ("h100/round24-2026-12-05/lease/r/smollm2-recipe-kd__train__metrics.jsonl.gz",
     "kd_round24_first1315_steady_state.json")])
def test_a_window_of_the_first_steps_is_what_the_script_makes_of_them(metrics, committed):
    """--steps 1315: round 25's cut run against round 24's whole one over the same steps."""
    rows = read_metrics(REPO / "bench" / "results" / metrics)
    want = json.loads((R25 / committed).read_text())
    assert steady_state_from_metrics.steady_state(rows[:1315], 5, None) == want
    assert want["steps_total"] == 1315


def test_a_scaled_citation_is_the_value_times_its_factor():
    ls3 = "bench/results/h200/round5-2026-12-01/loss_step3.json"
    s = json.loads((REPO / ls3).read_text())["step"][0]["s_per_step"]
    got = readme_figures.citations(f"{s * 1e3:.1f} ms<!-- fig: {ls3}#step.0.s_per_step*1e3 -->"
                                   f" and 0.1<!-- fig: {ls3}#step.0.s_per_step*-1 -->")
    assert got[0]["ok"] and got[0]["value"] == pytest.approx(s * 1e3)
    assert not got[1]["ok"] and got[1]["value"] == pytest.approx(-s)
    with pytest.raises(DFlashError, match=r"s_per_step\*ms: 'ms' is not a number"):
        readme_figures.citations(f"1.0<!-- fig: {ls3}#step.0.s_per_step*ms -->")


@pytest.mark.parametrize("run,log", [
    ("smollm2-quality-run2", "snakemake_call3.log"),
    ("round6-2026-12-01", "lease/logs/smollm2-quality/bench.log"),
    ("smollm2-greedy-run2", "bench.log")])
def test_the_figures_files_are_what_the_script_reads_from_their_logs(run, log):
    log = H200 / run / log
    committed = json.loads((H200 / run / "figures.json").read_text())
    assert figures_from_log.figures(log.read_text()) == {k: v for k, v in committed.items()
                                                        if k != "source"}


def test_a_whole_dag_logs_decode_rows_and_clock_are_its_committed_figures():
    """Round 16: the report lost its decoding sweep (batch 16 failed), so the rows that finished
    and the DAG's wall clock come from the log (``--decode``), as committed."""
    folder = H200 / "round16-2026-12-04"
    text = (folder / "lease" / "dag_quality.log").read_text()
    committed = json.loads((folder / "quality_dag_figures.json").read_text())
    got = figures_from_log.decode_and_clock(text)
    assert {k: committed[k] for k in ("decode", "dag_clock")} == got
    assert [r["batch"] for r in got["decode"]] == [1, 4] and got["dag_clock"]["span_s"] == 856.0
    assert figures_from_log.decode_and_clock("no stamps") == {"decode": [], "dag_clock": None}


def test_a_dag_run_over_two_invocations_reads_as_one_with_each_stages_seconds():
    """Round 26 ran kd's data and warm-up, then the arm's targets, as two Snakemake calls: the
    committed figures are the script's reading of both logs in order (the clock spans both),
    and each stage job's seconds come from the stamps around its start and its end; round 24's
    one-call DAG shows the decoders stage holding training back past the data stage."""
    folder = H100 / "round26-2026-12-06"
    logs = [folder / "lease" / n for n in ("dag_data.log", "dag_kd-epochs8.log")]
    committed = json.loads((folder / "kd_epochs8_dag_figures.json").read_text())
    texts = [p.read_text() for p in logs]
    assert committed["dag_clock"] == figures_from_log.decode_and_clock("\n".join(texts))["dag_clock"]
    assert committed["stages"] == [s for t in texts for s in figures_from_log.stage_spans(t)]
    sec = {s["rule"]: s["seconds"] for s in committed["stages"]}
    assert sec == {"env": 6.0, "warmup": 77.0, "data": 219.0, "train": 611.0, "bench": 66.0}
    assert committed["dag_clock"]["span_s"] == 917.0 and committed["source"] == [
        str(p.relative_to(REPO)) for p in logs]
    r24 = {s["rule"]: s for s in json.loads(
        (folder / "kd_round24_dag_figures.json").read_text())["stages"]}
    assert r24["train"]["start"] == r24["decoders"]["end"] > r24["data"]["end"]
    assert figures_from_log.stage_spans("no stamps") == []


def test_round17s_dag_figures_are_its_log_and_agree_with_its_report():
    """Round 17: the whole 6-epoch DAG's log rows (all four batch sizes this time) are the
    committed figures, and each row's speed-ups are the report's own, to the log's 3 decimals."""
    folder = H200 / "round17-2026-12-04"
    text = (folder / "lease" / "dag_quality.log").read_text()
    committed = json.loads((folder / "quality_dag_figures.json").read_text())
    got = figures_from_log.decode_and_clock(text)
    assert {k: committed[k] for k in ("decode", "dag_clock")} == got
    assert got["dag_clock"]["span_s"] == 1119.0 and got["dag_clock"]["span_s"] <= 20 * 60
    report = json.loads((folder / "lease" / "r" / "smollm2-quality__bench__report.json").read_text())
    batches = report["acceptance"]["decode_speed"]["batches"]
    assert [r["batch"] for r in got["decode"]] == [b["batch"] for b in batches] == [1, 4, 16, 64]
    for row, b in zip(got["decode"], batches):
        assert row["speedup"] == round(b["speedup"], 3)
        assert row["served_speedup"] == round(b["choice_speedup"], 3)
        assert row["lossless"] is True
