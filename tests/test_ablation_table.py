"""bench/ablation_table.py: the ablation table, its JSON and the verdicts come from the committed
GPU files; a table or JSON that disagrees with them is caught; bad input is one clear error."""
import json
import shutil
from pathlib import Path

import pytest

from bench import ablation_files, ablation_ref, ablation_table
from bench.figures_from_log import as_report
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
ROUND3 = REPO / "bench" / "results" / "h200" / "round3-2026-12-01" / "smollm2-recipe-1ep"


@pytest.fixture(scope="module")
def at():
    return ablation_table


@pytest.fixture(scope="module")
def data(at):
    return at.collect()


def test_committed_table_and_json_are_current(at):
    assert at.main(["--check", str(DOC)]) == 0


def test_a_json_or_table_that_disagrees_is_stale(at, tmp_path):
    js = json.loads(at.OUT_JSON.read_text())
    kd = next(r for r in js["arms"] if r["arm"] == "kd")
    kd["tau"]["mtbench"] += 0.01                                     # the JSON edited by hand
    bad_json = tmp_path / "ablation.json"
    bad_json.write_text(json.dumps(js, indent=1))
    assert at.main(["--json", str(bad_json), "--check", str(DOC)]) == 1
    md = tmp_path / "benchmarks.md"
    shutil.copy(DOC, md)
    md.write_text(md.read_text().replace("| 1.670 |", "| 1.700 |", 1))  # the table edited
    assert at.main(["--check", str(md)]) == 1
    assert at.main(["--json", str(tmp_path / "none.json"), "--check", str(DOC)]) == 1


def test_rows_carry_the_reports_figures_and_deltas(at, data):
    arms = {r["arm"]: r for r in data["arms"] if r["folder"].endswith("round3-2026-12-01/"
                                                                       "smollm2-recipe-1ep")}
    assert list(arms) == ["ref", "init-target", "kd"]                 # the sweep's order
    rep = {a: json.loads((ROUND3 / f"{a}__bench__report.json").read_text())["acceptance"][
        "sets"] for a in arms}
    for a, r in arms.items():
        for s in ("mtbench", "humaneval", "heldout", "train"):
            assert r["tau"][s] == round(rep[a][s]["tau"], 4)
        assert r["target_tokens"] == 10_704_967 and r["data_shared_by"] == 3
    d = arms["kd"]["delta"]
    assert d["mtbench"] == round(arms["kd"]["tau"]["mtbench"] - arms["ref"]["tau"]["mtbench"], 4)
    assert (arms["kd"]["verdict"], arms["init-target"]["verdict"]) == ("wins", "loses")
    # kd wins on τ but costs 1.29x ref's GPU-minutes: at ref's minutes it buys no more than
    # spending them would, so nothing is applied
    assert arms["kd"]["verdict_equal_gpu_minutes"] == "no change"
    assert arms["kd"]["apply"] == {} and arms["init-target"]["apply"] == {}
    # three trained at once: each about a third of the GPU; kd ran on alone at the end
    assert all(0.33 <= r["gpu_share"] < 0.4 for r in arms.values())
    assert sum(r["gpu_share"] for r in arms.values()) == pytest.approx(1.0, abs=0.1)
    runs = {r["arm"]: r for r in data["runs"]}
    assert runs["3 epochs (run 2)"]["target_tokens"] == 3 * 10_704_967
    line = next(ln for ln in at.render(data).splitlines() if ln.startswith("| kd |"))
    assert "| 1.670 | 1.588 | 1.891 | 1.935 | +0.055 | +0.047 | +0.063 | wins |" in line


def test_gpu_shares_split_each_second_between_the_runs_then(at):
    sh = at.gpu_shares({"a": (0, 10), "b": (0, 10), "c": (0, 20)})
    assert sh["a"] == sh["b"] == pytest.approx(1 / 3) and sh["c"] == pytest.approx(2 / 3)
    assert at.gpu_shares({"alone": (5, 9)}) == {"alone": 1.0}


def test_the_verdict_rule(at):
    ref = {"tau": {"mtbench": 1.6, "humaneval": 1.5, "heldout": 1.8, "train": None}}

    def arm(mt, he):
        return {"tau": {"mtbench": mt, "humaneval": he, "heldout": 1.8, "train": None}}
    assert at.verdict(arm(1.66, 1.5), ref)[1] == "wins"
    assert at.verdict(arm(1.70, 1.49), ref)[1] == "no change"      # HumanEval worse: no win
    assert at.verdict(arm(1.64, 1.6), ref)[1] == "no change"       # under the threshold
    assert at.verdict(arm(1.55, 1.6), ref)[1] == "loses"
    assert at.verdict(ref, ref)[1] == "reference"
    assert at.verdict(arm(1.7, 1.6), None)[1] == "no ref arm in this folder"


def test_the_verdict_at_equal_gpu_minutes(at):
    """The slope from the runs against the ref arms; an arm's Δ less what its extra minutes
    would buy ref; no slope without both kinds of point, or when the runs cost no more."""
    def row(arm, minutes, mt, he):
        return {"arm": arm, "gpu_minutes": minutes, "sweep": at.SLOPE_SWEEP,
                "tau": {"mtbench": mt, "humaneval": he, "heldout": None, "train": None}}
    slope = at.tau_per_doubling([row("ref", 1.0, 1.6, 1.5), row("kd", 1.3, 1.7, 1.6)],
                                [row("run", 4.0, 2.0, 1.9), row("run2", 4.0, 2.0, 1.9)])
    assert (slope["mtbench"], slope["humaneval"], slope["heldout"]) == (0.2, 0.2, None)
    eq = at.at_equal_gpu_minutes({"mtbench": 0.1, "humaneval": 0.05, "heldout": None,
                                  "train": None}, 2.0, slope)
    assert eq["mtbench"] == pytest.approx(-0.1) and eq["humaneval"] == pytest.approx(-0.15)
    assert at.rule(eq) == "loses"
    assert at.at_equal_gpu_minutes({"mtbench": 0.1, "humaneval": 0.0}, 1.0, slope)[
        "mtbench"] == 0.1                                       # same cost: Δ unchanged
    assert at.tau_per_doubling([], [row("run", 4.0, 2.0, 1.9)]) is None
    assert at.tau_per_doubling([row("ref", 4.0, 1.6, 1.5)], [row("run", 4.0, 2.0, 1.9)]) is None


def test_a_missing_arm_file_is_one_clear_error(at, tmp_path):
    (tmp_path / "x__bench__report.json").write_text(json.dumps(
        {"spec": "smollm2-recipe-1ep-x", "acceptance": {"sets": {}}}))
    # no train files at all (a lost machine's arm): not tabled, and named in the JSON
    assert at.arm_rows(tmp_path, ["smollm2-recipe-1ep"]) == []
    assert not at.has_train_files(tmp_path / "x__bench__report.json")
    (tmp_path / "x__train__manifest.json").write_text("{torn")
    with pytest.raises(DFlashError, match=r"x__train__manifest.json: not readable JSON"):
        at.arm_rows(tmp_path, ["smollm2-recipe-1ep"])
    md = tmp_path / "x.md"
    md.write_text("no markers")
    with pytest.raises(DFlashError, match="x.md: needs exactly one"):
        at.splice(md.read_text(), "t", str(md))


def test_timeline_adds_up_the_segments_of_a_resumed_train(at):
    steps = [{"step": 0, "t": 1.0, "tokens": 10}, {"step": 1, "t": 2.0, "tokens": 10},
             {"step": 1, "t": 0.5, "tokens": 10}, {"step": 2, "t": 1.5, "tokens": 10}]
    assert at.timeline(steps) == {0: (1.0, 10), 1: (2.5, 30), 2: (3.5, 40)}


def test_a_sweeps_base_run_is_its_ref_where_it_trains_as_ref_would(at, data):
    """Round 11 ran smollm2-quality itself beside two smollm2-recipe arms, not the ref arm: the
    sweep overrides bench only and ref overrides nothing, so the base's run is the ref (same
    lease, same training); a sweep whose overrides change training keeps needing its own ref."""
    assert at.base_as_ref("smollm2-recipe") == "smollm2-quality"
    assert at.base_as_ref("smollm2-recipe-1ep") is None          # its overrides set 1 epoch
    r11 = {r["arm"]: r for r in data["arms"] if "round11-2026-12-02" in r["folder"]}
    assert set(r11) == {"ref", "block8", "lr12e-4-beta2-0999"}
    assert r11["ref"]["ref_from"] == "smollm2-quality" and r11["ref"]["verdict"] == "reference"
    rep = json.loads((REPO / "bench/results/h200/round11-2026-12-02/lease/r/"
                      "smollm2-quality__bench__report.json").read_text())
    assert r11["ref"]["tau"]["mtbench"] == round(rep["acceptance"]["sets"]["mtbench"]["tau"], 4)
    assert r11["block8"]["delta"]["mtbench"] == round(
        r11["block8"]["tau"]["mtbench"] - r11["ref"]["tau"]["mtbench"], 4)
    # the τ-per-doubling slope still comes from the 1-epoch refs alone, not this 3-epoch ref
    assert data["tau_per_doubling"]["mtbench"] == 0.2166


def test_an_arm_whose_train_files_did_not_come_back_is_listed_not_tabled(data):
    """Round 13's ref arm: the report came back, its train folder (set aside for the readout A/B
    when the machine was lost) did not; it is cited from its report, never silently dropped."""
    r13 = "bench/results/h200/round13-2026-12-03/lease/r/smollm2-recipe-ref__bench__report.json"
    assert r13 in data["without_train_files"]
    assert not any("round13-2026-12-03" in r["folder"] for r in data["arms"])


R14 = REPO / "bench" / "results" / "h200" / "round14-2026-12-03" / "lease" / "r"


def test_round14s_arms_take_the_ref_round13_lends(data):
    """Round 14 ran no ref arm: its ref.json lends round 13's (the same dataset, the same training
    code). Δτ is against that report; the equal-minutes ratio is the reports' own train minutes
    on both sides (the lender's train files never came back)."""
    r14 = {r["arm"]: r for r in data["arms"] if "round14-2026-12-03" in r["folder"]}
    assert set(r14) == {"ref", "gamma4", "depth8", "anchors1344", "prompts15x-2ep", "prompts15x"}
    ref = r14["ref"]
    assert ref["ref_from"].startswith("bench/results/h200/round13-2026-12-03/")
    assert ref["verdict"] == "reference" and ref["tau"]["mtbench"] == 2.1522
    assert r14["prompts15x"]["delta"]["mtbench"] == 0.1679  # 2.3201 - 2.1522
    assert r14["prompts15x"]["verdict"] == r14["prompts15x"]["verdict_equal_gpu_minutes"] == "wins"
    assert r14["prompts15x"]["apply"]["data.max_prompts"] == 30600
    g = r14["gamma4"]
    assert g["gpu_minutes_ratio"] == round(g["report_train_minutes"] / ref["report_train_minutes"], 4)
    assert r14["depth8"]["verdict"] == "wins" and r14["depth8"]["verdict_equal_gpu_minutes"] == "no change"
    # round 14's two data stages ran at once: each arm's stage is flagged, no other round's is
    assert {r["data_beside"] for a, r in r14.items() if a != "ref"} == {1}
    assert not any(r.get("data_beside") for r in data["arms"] if "round14" not in r["folder"])


def test_a_lent_ref_that_does_not_compare_is_one_clear_error(at, tmp_path):
    for f in R14.glob("smollm2-recipe-gamma4__*"):
        if f.suffix != ".png":
            shutil.copy(f, tmp_path / f.name)
    lender = "bench/results/h200/round13-2026-12-03/lease/r/smollm2-recipe-ref__bench__report.json"
    ref = tmp_path / "ref.json"
    for doc, msg in (({"report": "bench/nothing.json", "why": "x"}, "is not a committed file"),
                     ({"report": lender}, "says not why"),
                     ({"report": lender.replace("round13", "round14").replace("-ref__", "-gamma4__"),
                       "why": "x"}, "is no ref arm")):
        ref.write_text(json.dumps(doc))
        with pytest.raises(DFlashError, match=f"ref.json: .*{msg}"):
            at.arm_rows(tmp_path, ["smollm2-recipe"])
    ref.write_text(json.dumps({"report": lender, "why": "the same data"}))
    assert [r["arm"] for r in at.arm_rows(tmp_path, ["smollm2-recipe"])] == ["gamma4", "ref"]
    manifest = tmp_path / "smollm2-recipe-gamma4__data__manifest.json"
    other = json.loads(manifest.read_text())
    other["dataset"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(other))
    with pytest.raises(DFlashError, match="ref.json: the lent ref trained on dataset d2ee1a4f16d5"):
        at.arm_rows(tmp_path, ["smollm2-recipe"])


R19 = REPO / "bench" / "results" / "h200" / "round19-2026-12-05" / "lease" / "r"
R17_QUALITY = "bench/results/h200/round17-2026-12-04/lease/r/smollm2-quality__bench__report.json"


def test_round19s_data_arms_take_round17s_base_run_as_ref(data):
    """Round 19 ran only data arms (the steered prompts): its ref.json lends round 17's run of
    the sweep's base, whose dataset two committed runs made byte-identical (rounds 16 and 17)."""
    r19 = {r["arm"]: r for r in data["arms"] if "round19-2026-12-05" in r["folder"]}
    assert set(r19) == {"ref", "steered", "steered-gamma4-depth8"}
    assert r19["ref"]["ref_from"] == R17_QUALITY and r19["ref"]["tau"]["mtbench"] == 2.5811
    combo = r19["steered-gamma4-depth8"]
    assert combo["delta"]["mtbench"] == round(combo["tau"]["mtbench"] - 2.5811, 4) > 0.3
    assert combo["verdict"] == combo["verdict_equal_gpu_minutes"] == "wins"
    assert combo["apply"]["loss.gamma"] == 4 and combo["apply"]["drafter.num_layers"] == 8


def test_a_lent_base_run_needs_data_arms_and_a_reproduced_dataset(at, tmp_path, monkeypatch):
    for f in R19.glob("smollm2-recipe-steered__*"):
        if f.suffix != ".png":
            shutil.copy(f, tmp_path / f.name)
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"report": R17_QUALITY, "why": "the base's run, data reproduced"}))
    assert [r["arm"] for r in at.arm_rows(tmp_path, ["smollm2-recipe"])] == ["steered", "ref"]
    # a base dataset no other committed run made: the lent ref's data is not shown to be the one
    # this folder's ref would have trained on
    monkeypatch.setattr(ablation_ref, "_reproduced", lambda sha, report: False)
    with pytest.raises(DFlashError, match="ref.json: the lent ref trained on dataset fe0fc3c35671, "
                                          "no arm here did and no other committed run made it"):
        at.arm_rows(tmp_path, ["smollm2-recipe"])
    # an arm that keeps the base's data (gamma4) cannot borrow another dataset's ref
    monkeypatch.undo()
    for f in tmp_path.glob("smollm2-recipe-steered__*"):
        f.rename(f.with_name(f.name.replace("-steered__", "-gamma4__")))
    report = tmp_path / "smollm2-recipe-gamma4__bench__report.json"
    report.write_text(json.dumps(dict(json.loads(report.read_text()), spec="smollm2-recipe-gamma4")))
    with pytest.raises(DFlashError, match="ref.json: the lent ref trained on dataset fe0fc3c35671, "
                                          "no arm here did$"):
        at.arm_rows(tmp_path, ["smollm2-recipe"])


def test_a_run_that_trained_an_arms_recipe_is_lent_as_ref(at, tmp_path):
    """Round 19's candidate arm became the sweep's base, and since round 26 (soft labels for 8
    epochs) its recipe is the ``ce`` arm's: its run recorded the training, shape and data
    fingerprints that arm has, so a folder's arm (here a stand-in: its files under another arm's
    name, keeping the base's data) may borrow it as ref where ref.json says ``trained_as: ce``.
    Without it the check is against today's ref (kd), which that run did not train as; a run of
    another recipe is refused either way."""
    cand = "bench/results/h200/round19-2026-12-05/lease/r/" \
           "smollm2-recipe-steered-gamma4-depth8__bench__report.json"
    for f in R19.glob("smollm2-recipe-steered-gamma4-depth8__*"):
        if f.suffix != ".png":
            shutil.copy(f, tmp_path / f.name.replace("-steered-gamma4-depth8__", "-epochs9__"))
    report = tmp_path / "smollm2-recipe-epochs9__bench__report.json"
    report.write_text(json.dumps(dict(json.loads(report.read_text()), spec="smollm2-recipe-epochs9")))
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"report": cand, "why": "round 19's run of the ce arm's recipe",
                               "trained_as": "ce"}))
    rows = {r["arm"]: r for r in at.arm_rows(tmp_path, ["smollm2-recipe"])}
    assert set(rows) == {"epochs9", "ref"} and rows["ref"]["ref_from"] == cand
    assert rows["ref"]["tau"]["mtbench"] == rows["epochs9"]["tau"]["mtbench"] == 2.8819
    ref.write_text(json.dumps({"report": cand, "why": "today's ref is kd for 8 epochs"}))
    with pytest.raises(DFlashError, match="is no ref arm of the sweeps here .* and trained not "
                                          "as their 'ref' arm does"):
        at.arm_rows(tmp_path, ["smollm2-recipe"])
    steered = cand.replace("-gamma4-depth8__", "__")
    ref.write_text(json.dumps({"report": steered, "why": "not the recipe", "trained_as": "ce"}))
    with pytest.raises(DFlashError, match="trained not as their 'ce' arm does"):
        at.arm_rows(tmp_path, ["smollm2-recipe"])


def test_round16s_cut_arm_is_tabled_from_its_figures_against_the_dags_run(data):
    """Round 16's epochs6 arm: the call's limit cut its bench stage after MT-Bench and HumanEval,
    so its row comes from ``<arm>__bench__figures.json`` (the bench log's lines, no report); its
    ref is the whole DAG's smollm2-quality run of the same lease. The sets it never measured are
    None, not zeros, and it wins at equal GPU-minutes too (the default since)."""
    r16 = {r["arm"]: r for r in data["arms"] if "round16-2026-12-04" in r["folder"]}
    assert set(r16) == {"ref", "epochs6"} and r16["ref"]["ref_from"] == "smollm2-quality"
    e = r16["epochs6"]
    assert e["tau"] == {"mtbench": 2.577, "humaneval": 2.643, "heldout": None, "train": None}
    assert e["delta"]["mtbench"] == round(2.577 - r16["ref"]["tau"]["mtbench"], 4)
    assert e["steps"] == 2 * r16["ref"]["steps"] and e["while_training"] == []
    assert e["verdict"] == e["verdict_equal_gpu_minutes"] == "wins"
    assert e["apply"] == {"optim.epochs": 6}


def test_a_cut_benchs_figures_file_that_does_not_read_is_one_clear_error(tmp_path):
    path = tmp_path / "smollm2-recipe-epochs6__bench__figures.json"
    for text in ("{not json", '{"tau": {"mtbench": {"prompts": 80}}}', "[]"):
        path.write_text(text)
        with pytest.raises(DFlashError, match="smollm2-recipe-epochs6__bench__figures.json"):
            as_report(path)


def test_another_gpus_rounds_come_after_the_h200_ones(data, monkeypatch, tmp_path):
    """The docs cite ablation.json's arms by index: the H200's folders keep their sorted order and
    another GPU's round (round 22's H100) comes after them, under its GPU's name, with the run
    it lends as ref (round 19's candidate, on the byte-identical dataset)."""
    rows = [(r["arm"], ablation_files.short(r["folder"])) for r in data["arms"]]
    h100 = [i for i, (_, f) in enumerate(rows) if f.startswith("h100/")]
    assert h100 and h100 == list(range(len(rows) - len(h100), len(rows)))
    assert rows[h100[0]] == ("epochs10", "h100/round22-2026-12-05/lease/r")
    ref = data["arms"][h100[1]]
    assert ref["arm"] == "ref" and "round19-2026-12-05" in ref["ref_from"]
    assert data["arms"][h100[0]]["verdict_equal_gpu_minutes"] == "loses"
    # the order itself: per GPU, sorted (round10 before round9, as the H200 rows always were)
    for gpu, rnd in (("h200", "round9"), ("h200", "round10"), ("h100", "round1")):
        (tmp_path / gpu / rnd).mkdir(parents=True)
        (tmp_path / gpu / rnd / "a__bench__report.json").write_text("{}")
    monkeypatch.setattr(ablation_files, "GPUS", (tmp_path / "h200", tmp_path / "h100"))
    assert [f"{p.parent.name}/{p.name}" for p in ablation_files.committed_folders(
        ablation_files.committed("*__bench__report.json"))] == ["h200/round10", "h200/round9",
                                                                "h100/round1"]
