"""The bench stage's τ on the real SmolLM2 target: eval sets, the report, one-line failures."""
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from jinja2 import Environment, FileSystemLoader, StrictUndefined

from dflash.decode.generate import eos_ids_of
from dflash.errors import DFlashError, SpecError
from dflash.eval.evalsets import (_key, heldout_prompts, load_eval_sets, training_prompts,
                                  user_prompt)
from dflash.eval.report import ci, fmt, width_series, write_plots
from dflash.eval.serving import verify_widths
from dflash.decode.eager import speculative_generate
from dflash.eval.tau import simulate, summarize
from dflash.eval.tau_monitor import TauMonitor
from dflash.models.drafter import DFlashConfig, DFlashDrafter, export_drafter
from dflash.models.masks import PackedRow
from dflash.train.anchors import sample_anchors
from dflash.models.target import load_target
from dflash.spec.load import load_spec
from dflash.stages.bench import decode_speed, evaluate_tau
from dflash.train.workers import initial_state, make_replicas

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Small shapes: one intra-op thread is faster and robust to a busy machine."""


def spec_with(tmp_path, **bench):
    raw = yaml.safe_load((REPO / "specs" / "tiny.yaml").read_text())
    raw["bench"].update(bench)
    path = tmp_path / "specs" / "tiny.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return load_spec(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A random-weight drafter for the tiny spec, exported as the train stage does."""
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    cfg = DFlashConfig.of_spec(spec)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("drafter") / "drafter"
    export_drafter(DFlashDrafter(cfg), cfg, out)
    return out


def test_eval_sets_mtbench_categories_humaneval_heldout(tmp_path):
    spec = spec_with(tmp_path)
    tok = load_target(spec.target, "cpu").tokenizer
    mt, he = load_eval_sets(spec, None, tok, ["mtbench", "humaneval"], 1000)
    assert len(mt.prompts) == 80 and len(set(mt.categories)) == 8
    assert all(mt.categories.count(c) == 10 for c in set(mt.categories))
    assert len(he.prompts) == 164
    assert "def " in tok.decode(he.prompts[0]) and "<|im_start|>user" in tok.decode(he.prompts[0])
    # held out: never a prompt the training data holds (read from the dataset parquet)
    first, _ = heldout_prompts(spec, None, tok, 5)
    assert len(first) == 5

    (tmp_path / "data").mkdir()
    used = first[:3]
    pq.write_table(pa.table({"input_ids": [p + [1, 2] for p in used],
                             "num_prompt_tokens": [len(p) for p in used]}),
                   tmp_path / "data" / "dataset.parquet")
    again, note = heldout_prompts(spec, tmp_path, tok, 5)
    assert len(again) == 5 and not any(p in used for p in again)
    assert again[:2] == first[3:5] and "3 training prompts excluded" in note


def test_training_prompts_are_each_samples_prompt_ids_from_the_flat_column(tmp_path):
    """The held-out set's exclusion keys: each row's first num_prompt_tokens ids (clamped to the
    row, as a list slice is), whatever the parquet's int width, across row groups."""
    rows = [[5, 6, 7, 1, 2], [5, 6, 9], [8]]
    table = pa.table({"input_ids": pa.array(rows, type=pa.list_(pa.int32())),
                      "num_prompt_tokens": [3, 2, 4]})
    pq.write_table(table, tmp_path / "ds.parquet", row_group_size=2)
    assert training_prompts(tmp_path / "ds.parquet") == {_key([5, 6, 7]), _key([5, 6]), _key([8])}
    assert _key([5, 6, 7]) != _key([5, 6]) and _key((5, 6)) == _key([5, 6])


def test_evaluate_tau_report_and_markdown(tmp_path, exported):
    spec = spec_with(tmp_path, eval_sets=["mtbench", "humaneval", "heldout"], eval_prompts=2,
                     eval_max_new_tokens=6, real_prompts=1)
    tau = evaluate_tau(spec, exported, "cpu", tmp_path)
    assert set(tau["sets"]) == {"mtbench", "humaneval", "heldout"}
    assert tau["primary_set"] == "mtbench" and tau["tau"] == tau["sets"]["mtbench"]["tau"]
    for name, s in tau["sets"].items():             # τ is tokens over verification forwards
        assert s["tau"] == s["tokens"] / s["forwards"] and 1.0 <= s["tau"] <= 16.0, name
    for name, s in tau["sets"].items():
        assert s["prompts"] == 2 and len(s["accept_rate_by_position"]) == 15, name
        assert ("real" in s) == (name == "mtbench"), name      # real decoding: first set only
    real = tau["sets"]["mtbench"]["real"]
    assert real["prompts"] == 1 and real["lossless"] is True and real["tokens_equal_simulated"] == 1
    # real decoding (independent of the chain walk) ran the blocks the simulation predicted
    assert real["blocks_equal_simulated"] == 1
    assert real["tau"] == real["tau_simulated_same_prompts"]
    # 2 of 80 questions: one from each of the first two categories, not the file's first two
    assert set(tau["sets"]["mtbench"]["tau_by_category"]) == {"writing", "roleplay"}
    assert tau["sets"]["mtbench"]["prompts_by_category"] == {"roleplay": 1, "writing": 1}
    assert tau["lossless"] is True
    report = {"acceptance": tau}
    # every declared plot is written (a report output of the bench rule); without training
    # steps, loss and throughput say so instead of plotting
    assert write_plots(tmp_path, [], tau) == ["loss.png", "throughput.png",
                                              "draft_accuracy.png", "tau_training.png",
                                              "acceptance.png", "tau_by_category.png",
                                              "decode_speed.png"]
    assert all((tmp_path / p).stat().st_size > 1000 for p in write_plots(tmp_path, [], tau))
    env = Environment(loader=FileSystemLoader(REPO / "dflash" / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    src = env.loader.get_source(env, "report.md.j2")[0]
    part = src[src.index("## Acceptance length"):src.index("## Step time")]
    md = env.from_string(part).render(r=report, fmt=fmt, ci=ci)
    assert "| mtbench | 2 |" in md and "| humaneval | 2 |" in md and "writing" in md
    # τ from 2 prompts carries its 95 % interval over prompts (dflash/eval/spread.py)
    mt = tau["sets"]["mtbench"]
    lo, hi = mt["tau_ci95"]
    assert lo <= mt["tau"] <= hi and f"| {fmt(mt['tau'])} [{fmt(lo)}, {fmt(hi)}] |" in md
    # the batch sweep is CUDA-only; the lossless evidence of the real decode is reported
    assert tau["decode_speed"]["skipped"].startswith("on cpu")
    assert "Skipped: on cpu" in md and "emitted tokens checked, 0 not the verify argmax" in md
    # the reference protocol is off by default (bench.protocols: [dflash]): said, not measured
    assert set(tau["protocols"]) == {"dflash"} and "not measured (`bench.protocols`" in md
    assert tau["protocols"]["dflash"]["tau_prompt_mean"] == tau["sets"]["mtbench"][
        "tau_prompt_mean"]


@pytest.fixture(scope="module")
def with_reference(tmp_path_factory, exported):
    """One evaluation for the two tests below (each run costs ~12 s on 2 cores): MT-Bench with
    real decoding of one prompt, then the train set, which reads a dataset of 3 prompts, and the
    reference protocol (bench.protocols [dflash, reference]). (spec, results dir, τ, tokenizer)"""
    tmp = tmp_path_factory.mktemp("with-reference")
    spec = spec_with(tmp, eval_sets=["mtbench", "train"], eval_prompts=2,
                     eval_max_new_tokens=6, real_prompts=1, protocols=["dflash", "reference"],
                     reference_max_new_tokens=8)
    tok = load_target(spec.target, "cpu").tokenizer
    trained = [user_prompt(tok, t) for t in ("Hello there.", "What is a cat?", "Tell a joke.")]
    (tmp / "data" / "self_written").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": [0, 1, 2], "input_ids": [p + [2] for p in trained],
                             "num_prompt_tokens": [len(p) for p in trained]}),
                   tmp / "data" / "dataset.parquet")
    # prompt 0 from the corpus, 1-2 self-written (steered: math, then writing)
    (tmp / "data" / "self_written" / "categories.json").write_text(
        json.dumps({"categories": ["math", "writing"]}))
    (tmp / "data" / "manifest.json").write_text(json.dumps(
        {"sources": {"chatterbot-corpus": {}, "self-written": {"first_prompt_id": 1}}}))
    return spec, tmp, evaluate_tau(spec, exported, "cpu", tmp), tok  # (the session's 1 thread)


def test_reference_protocol_and_train_set_in_the_report(with_reference):
    """bench.protocols [dflash, reference]: both turns of 2 questions, both aggregations, the
    caps, beside ours in report.json and report.md; the train set reads the dataset."""
    spec, tmp_path, tau, tok = with_reference
    train = tau["sets"]["train"]
    assert train["prompts"] == 2 and "of the 3 distinct" in train["note"]
    # τ per self-written category of the sampled prompts; the corpus prompt counts in none
    picked = load_eval_sets(spec, tmp_path, tok, ["train"], 2)[0].categories
    want = {c: picked.count(c) for c in ("math", "writing") if c in picked}
    assert train["prompts_by_category"] == want and set(train["tau_by_category"]) == set(want)
    assert all(1.0 <= t <= 16.0 for t in train["tau_by_category"].values())
    ref, ours = tau["protocols"]["reference"], tau["protocols"]["dflash"]
    assert ours["tau"] == tau["sets"]["mtbench"]["tau"] and ours["max_new_tokens"] == 6
    assert ref["questions"] == 2 and ref["prompts"] == 4 and ref["max_new_tokens"] == 8
    t1, t2 = ref["by_turn"]["turn1"], ref["by_turn"]["turn2"]
    assert t1["prompts"] == t2["prompts"] == 2
    assert t1["tokens"] + t2["tokens"] == ref["tokens"]
    assert ref["tau"] == ref["tokens"] / ref["forwards"]
    assert ref["max_context"] == 8192 and ref["hit_cap"]["context"] == 0
    assert sum(ref["hit_cap_by_turn"][t]["max_new_tokens"] for t in ("turn1", "turn2")) == \
        ref["hit_cap"]["max_new_tokens"]
    assert ref["generator"] == "fast engine"
    assert set(ref["tau_prompt_mean_by_category"]) == {"writing", "roleplay"}
    env = Environment(loader=FileSystemLoader(REPO / "dflash" / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    src = env.loader.get_source(env, "report.md.j2")[0]
    md = env.from_string(src[src.index("## Acceptance length"):src.index("## Step time")]
                         ).render(r={"acceptance": tau}, fmt=fmt, ci=ci)
    assert f"| dflash (ours) | first | 6 | 2 | {fmt(ours['tau'])} |" in md
    assert f"| reference | both | 8 | 4 | {fmt(ref['tau'])} | **{fmt(ref['tau_prompt_mean'])}** |" in md
    assert "| reference, turn2 only | turn2 | 8 | 2 |" in md and "| train | 2 |" in md
    line = "τ per train category (prompts): " + ", ".join(
        f"{c} {fmt(t)} ({train['prompts_by_category'][c]})"
        for c, t in train["tau_by_category"].items())
    assert line in md and "τ per mtbench category (prompts): " in md
    assert "Not recorded (a report from before bench_seconds)" in md


def test_bench_seconds_count_each_part(with_reference):
    """The τ part's own cost (#35 item 4): loading, each set (real decoding on the first), the
    reference protocol when on, the decode sweep (skipped on CPU), in report.json and report.md."""
    tau = with_reference[2]
    sec = tau["seconds"]
    assert set(sec) == {"load_s", "eval_sets_s", "reference_s", "decode_sweep_s", "sets",
                        "hf_static_timed_s"}
    assert sec["sets"]["mtbench"]["simulated_s"] == tau["sets"]["mtbench"]["simulated_s"] > 0
    assert sec["sets"]["mtbench"]["real_s"] == tau["sets"]["mtbench"]["real"]["seconds"] > 0
    assert sec["sets"]["train"]["real_s"] is None  # real decoding: the first set only
    # the sets' wall holds their simulated and real seconds; the reference ran and was timed
    parts = sum(v["simulated_s"] + (v["real_s"] or 0) for v in sec["sets"].values())
    assert parts <= sec["eval_sets_s"] + 0.05 and sec["reference_s"] > 0
    assert sec["hf_static_timed_s"] is None  # no sweep on CPU
    report = {"acceptance": tau, "bench_seconds": {"throughput_s": 1.5, "tau_s": 9.25,
                                                   "total_s": 10.75, "tau_parts": sec}}
    env = Environment(loader=FileSystemLoader(REPO / "dflash" / "templates"),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    src = env.loader.get_source(env, "report.md.j2")[0]
    md = env.from_string(src[src.index("## Where the bench"):src.index("## Step time")]
                         ).render(r=report, fmt=fmt, ci=ci)
    assert "Whole stage 10.8 s" in md and "τ and decoding 9.25" in md
    assert (f"| τ mtbench: simulated + real decoding {fmt(sec['sets']['mtbench']['real_s'])} s "
            f"| {fmt(sec['sets']['mtbench']['simulated_s'])} |") in md
    assert f"| reference protocol | {fmt(sec['reference_s'])} |" in md
    no_ref = dict(sec, reference_s=None)
    md = env.from_string(src[src.index("## Where the bench"):src.index("## Step time")]
                         ).render(r={"bench_seconds": dict(report["bench_seconds"],
                                                           tau_parts=no_ref)}, fmt=fmt, ci=ci)
    assert "| reference protocol | not run |" in md


def test_bench_failure_is_one_message_naming_the_file(tmp_path, exported):
    spec = spec_with(tmp_path, eval_prompts=1, eval_max_new_tokens=4)
    broken = tmp_path / "broken"
    broken.mkdir()
    cfg = json.loads((exported / "config.json").read_text())
    cfg["hidden_size"] = 32                      # weights no longer fit the config
    (broken / "config.json").write_text(json.dumps(cfg))
    (broken / "model.safetensors").write_bytes((exported / "model.safetensors").read_bytes())
    with pytest.raises(DFlashError) as e:
        evaluate_tau(spec, broken, "cpu", tmp_path)
    msg = str(e.value)
    # no cause: the CLI then prints this one line and no traceback (dflash/cli.py)
    assert "\n" not in msg and e.value.__cause__ is None and e.value.__suppress_context__
    assert f"loading the exported drafter {broken}" in msg and "drafter.dtype" in msg
    assert (tmp_path / "bench" / "tau_error.txt").read_text().startswith("Traceback")


def test_tau_monitor_equals_simulated_tau_of_the_replica(tmp_path):
    """The training-time τ monitor gives the simulated τ of the replica's current weights."""
    raw = yaml.safe_load((REPO / "tests" / "specs" / "micro.yaml").read_text())
    path = tmp_path / "micro.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_spec(path)
    cfg = DFlashConfig.of_spec(spec)
    rep = make_replicas(spec, cfg, initial_state(cfg, 0), 10)[0]
    lines = []
    mon = TauMonitor(spec, tmp_path, "cpu", log=lines.append)
    # the set-up's line says where its seconds went; the parts add up to the whole
    parts = [float(x) for x in re.findall(r"(\d+\.\d)s", lines[0])]
    assert lines[0].startswith("[train] τ monitor: 3 held-out prompts") and len(parts) == 4
    assert abs(sum(parts[1:]) - parts[0]) <= 0.15
    got = mon(rep)
    tgt = load_target(spec.target, "cpu", seed=spec.seed)
    prompts, _ = heldout_prompts(spec, tmp_path, tgt.tokenizer, 3)
    sim = simulate(tgt.model, rep.model, rep.embed, rep.lm_head, prompts, 8, [2],
                   cfg.target_layer_ids, "cpu")
    assert mon.conts == sim["continuations"] and len(prompts) == 3
    assert got["tau"] == summarize(sim["chains"], cfg.block_size)["tau"] >= 1.0


def test_tau_monitor_equals_real_decoding_of_a_trained_replica(tmp_path):
    """The monitor against an independent computation: real speculative decoding (SmolLM2 run
    step by step, its own features, the drafter's KV cache; τ = tokens after the prefill one
    over verification forwards, no chain walk) of the same prompts, with a replica trained
    through its own training step until some of its drafts are accepted."""
    spec = spec_with(tmp_path).replace(
        compile={"backend": "eager"}, drafter={"block_size": 4},
        optim={"lr": 1e-2, "warmup_ratio": 0.0},
        monitor={"tau_every_steps": 1, "tau_prompts": 3, "tau_max_new_tokens": 24})
    cfg = DFlashConfig.of_spec(spec)
    rep = make_replicas(spec, cfg, initial_state(cfg, 0), 400)[0]
    mon = TauMonitor(spec, tmp_path, "cpu", log=lambda _: None)
    assert mon(rep)["tau"] == 1.0                       # untrained: no draft accepted
    for step in range(12):
        i = step % len(mon.seqs)
        L = len(mon.seqs[i])
        row = PackedRow(torch.tensor(mon.seqs[i]), torch.zeros(L, dtype=torch.long),
                        torch.arange(L), torch.arange(L) >= mon.starts[i], [0])
        rep.zero_grad()
        rep.forward_backward(row, mon.feats[i][None],
                             sample_anchors(row, L, cfg.block_size, None, cfg.mask_token_id))
        rep.clip_and_step()
    rep.model.eval()
    got = mon(rep)["tau"]
    tgt = load_target(spec.target, "cpu", seed=spec.seed)
    tokens = forwards = 0
    blocks = []
    for seq, start, cont in zip(mon.seqs, mon.starts, mon.conts):
        res = speculative_generate(tgt.model, rep.model, cfg, rep.embed, rep.lm_head,
                                   torch.tensor(seq[:start]), spec.monitor.tau_max_new_tokens,
                                   eos_ids_of(tgt))
        assert res.tokens == list(cont)                 # lossless (fp32 CPU)
        tokens, forwards = tokens + len(res.tokens) - 1, forwards + res.target_forwards
        blocks += res.block_lengths
    assert got == tokens / forwards
    assert max(blocks) >= 2 and min(blocks) == 1, blocks  # accepted drafts, and rejected ones


def test_decode_batches_choose_the_sweep(tmp_path):
    """bench.decode_batches: the sweep's batch sizes (default 1, 4, 16, 64); [] skips it before
    anything loads; a bad entry names the field."""

    assert spec_with(tmp_path).bench.decode_batches == (1, 4, 16, 64)
    b = spec_with(tmp_path, decode_batches=[]).bench
    assert decode_speed(None, None, None, None, None, b, "cuda:0") == {
        "skipped": "bench.decode_batches is []"}
    b = spec_with(tmp_path, decode_batches=[2, 8]).bench
    assert b.decode_batches == (2, 8)
    assert "on cpu" in decode_speed(None, None, None, None, None, b, "cpu")["skipped"]
    with pytest.raises(SpecError, match="decode_batches"):
        spec_with(tmp_path, decode_batches=[0])


def test_decode_widths_are_the_sweep_s_verify_widths(tmp_path):
    """bench.decode_widths: verify widths timed beside the full block (default 4, 8, 16),
    clipped to the block and deduplicated when measured; a width below 2 (an anchor without
    drafts) or a repeated one names the field."""
    assert spec_with(tmp_path).bench.decode_widths == (4, 8, 16)
    assert spec_with(tmp_path, decode_widths=[2, 32]).bench.decode_widths == (2, 32)
    assert verify_widths((4, 8, 16, 32), 16) == [4, 8, 16] and verify_widths((32, 8), 5) == [5]
    for bad in ([1], [4, 4], []):
        with pytest.raises(SpecError, match="decode_widths"):
            spec_with(tmp_path, decode_widths=bad)
    with pytest.raises(DFlashError, match="bench.decode_widths"):
        verify_widths([1, 4], 16)


def test_decode_shapes_is_static_unless_the_spec_says_dynamic(tmp_path):
    """bench.decode_shapes: static by default (a graph per shape, as every committed sweep
    ran), dynamic on request; anything else names the field."""
    assert spec_with(tmp_path).bench.decode_shapes == "static"
    assert spec_with(tmp_path, decode_shapes="dynamic").bench.decode_shapes == "dynamic"
    with pytest.raises(SpecError, match="decode_shapes"):
        spec_with(tmp_path, decode_shapes="symbolic")


def test_decode_plot_draws_each_narrower_verify_width(tmp_path):
    """decode_speed.png: a line per verify width narrower than the row's full block, from the
    sweep rows' ``widths``; the full block is the row's own line, and an older row without
    ``widths`` adds none (and still plots)."""
    def row(batch, widths):
        return {"batch": batch, "target_only_tokens_per_s": 100.0 * batch,
                "speculative_tokens_per_s": 150.0 * batch,
                "served": {"tokens_per_s": 150.0 * batch},
                "widths": [{"width": w, "tokens_per_s": t} for w, t in widths]}
    speed = [row(1, [(4, 120.0), (8, 140.0), (16, 150.0)]),
             row(4, [(4, 460.0), (8, 0.0), (16, 600.0)]),   # a width with no timing: no point
             {**row(16, []), "widths": None}]
    assert width_series(speed) == {4: [(1, 120.0), (4, 460.0)], 8: [(1, 140.0)]}
    assert width_series([{**r, "widths": None} for r in speed]) == {}
    for name, rows in (("with", speed), ("without", [{k: v for k, v in r.items() if k != "widths"}
                                                     for r in speed])):
        out = tmp_path / name
        out.mkdir()
        assert "decode_speed.png" in write_plots(out, [], {"decode_speed": {"batches": rows}})
        assert (out / "decode_speed.png").stat().st_size > 1000
