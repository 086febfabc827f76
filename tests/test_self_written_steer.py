"""Self-written prompts steered toward the evaluation categories (data.self_written.categories)."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest
import yaml

from dflash.data import sources
from dflash.data.check import check_data
from dflash.data.prompts import CHATTERBOT
from dflash.data.self_written import (
    CATEGORIES,
    CATEGORIES_FILE,
    assign_categories,
    prefixes,
    prompt_categories,
    user_turn_prefix,
    write_prompts,
)
from dflash.errors import DFlashError, SpecError
from dflash.eval.evalsets import eval_overlap
from dflash.spec.load import load_spec, parse_spec, schema, section_spec
from dflash.stages import StageContext
from dflash.stages import data as data_stage
from dflash.spec.sweeps import load_sweep

ROOT = Path(__file__).resolve().parents[1]
SW = section_spec("data", {"source": CHATTERBOT}).self_written


@pytest.fixture(scope="module")
def tok():
    return sources.tokenizer_for("smollm2-135m-instruct")


def test_steered_prefix_carries_the_cue_and_ends_where_the_user_text_begins(tok):
    plain = tok.decode(user_turn_prefix(tok))
    for cat, cue in CATEGORIES.items():
        text = tok.decode(user_turn_prefix(tok, cue))
        assert text == f"<|im_start|>system\n{cue}<|im_end|>\n<|im_start|>user\n", cat
        assert text != plain
    # unsteered: the one default prefix, as before the categories existed
    assert prefixes(tok, ()) == {None: user_turn_prefix(tok)}
    assert tok.decode(prefixes(tok, ("math",))["math"]).count(CATEGORIES["math"]) == 1


def test_cues_name_the_schema_categories_and_hold_no_eval_text():
    enum = schema()["properties"]["data"]["properties"]["self_written"]["properties"][
        "categories"]["items"]["enum"]
    assert enum == list(CATEGORIES)
    for cat, cue in CATEGORIES.items():  # no MT-Bench / HumanEval n-gram in a cue
        assert eval_overlap([{"role": "user", "content": cue}], 8) is None, cat


def test_categories_are_assigned_evenly_and_reproducibly():
    cats = ("writing", "math", "coding")
    start, seen = 0, Counter()
    rounds = []
    for rnd, n in enumerate([13, 5, 4]):  # rounds shrink as prompts are kept
        got = assign_categories(cats, 7, rnd, start, n)
        assert len(got) == n and set(got) <= set(cats)
        assert max(Counter(got).values()) - min(Counter(got).get(c, 0) for c in cats) <= 1
        seen.update(got)
        rounds.append(got)
        start += n
    assert sorted(seen.values()) == [7, 7, 8]  # even over all rounds: 22 = 8 + 7 + 7
    again = [assign_categories(cats, 7, r, s, n) for r, s, n in [(0, 0, 13), (1, 13, 5), (2, 18, 4)]]
    assert again == rounds
    other = assign_categories(cats, 8, 0, 0, 13)
    assert other != rounds[0] and Counter(other) == Counter(rounds[0])  # seeded order only
    assert assign_categories((), 7, 0, 0, 3) == [None, None, None]


def _writer(tok):
    """Stands in for the target's sampler: writes a request naming the category whose cue it
    was given (so a kept prompt's recorded category can be checked against its text); a
    'coding' cue gets an unterminated turn on even seeds (filtered: kept counts differ)."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    by_prefix = {tuple(p): c for c, p in prefixes(tok, tuple(CATEGORIES)).items()}

    def sample(prompts, seeds):
        out = []
        for p, s in zip(prompts, seeds):
            cat = by_prefix[tuple(p)]
            ids = tok(f"Please help me with this {cat} request number {s}.",
                      add_special_tokens=False)["input_ids"]
            out.append(ids if cat == "coding" and s % 2 == 0 else ids + [eos])
        return out
    return sample, eos


def test_kept_prompts_record_their_category(tok, tmp_path):
    sample, eos = _writer(tok)
    settings = dataclasses.replace(SW, categories=("writing", "coding", "stem"), oversample=1.0)
    kept, rep = write_prompts(12, sample=sample, tokenizer=tok, eos_ids=[eos], settings=settings,
                              seed=3, ident="t", round_dir=tmp_path, seen=set(), log=lambda m: None)
    saved = json.loads((tmp_path / CATEGORIES_FILE).read_text())
    assert len(saved["categories"]) == len(kept) == 12
    for p, cat in zip(kept, saved["categories"]):
        assert f" {cat} request" in p.user_text and p.where.startswith(f"self-written:{cat}:")
        assert p.messages == [{"role": "user", "content": p.user_text}]  # no cue in the prompt
    counts = rep["categories"]
    assert saved["counts"] == counts
    assert {c: v["kept"] for c, v in counts.items()} == dict(Counter(saved["categories"]))
    assert sum(v["candidates"] for v in counts.values()) == rep["candidates"]
    assert rep["filtered"].get("unterminated", 0) >= 1 and counts["coding"]["kept"] < \
        counts["writing"]["kept"]
    # the round files record where each round's assignment started; a rerun reuses them
    meta = json.loads((tmp_path / "round-0000.json").read_text())["meta"]
    assert meta["start"] == 0 and meta["n"] == 12
    again, rep2 = write_prompts(12, sample=None, tokenizer=tok, eos_ids=[eos], settings=settings,
                                seed=3, ident="t", round_dir=tmp_path, seen=set(),
                                log=lambda m: None)
    assert rep2["rounds_reused"] == rep["rounds"] and [p.messages for p in again] == \
        [p.messages for p in kept]


def test_unsteered_writes_as_before(tok, tmp_path):
    sample, eos = _writer(tok)
    plain = tuple(user_turn_prefix(tok))

    def default_only(prompts, seeds):  # every candidate gets the one default prefix
        assert {tuple(p) for p in prompts} == {plain}
        return [tok("Tell me a fact about owls, please.", add_special_tokens=False)["input_ids"]
                + [eos] for _ in seeds]
    kept, rep = write_prompts(1, sample=default_only, tokenizer=tok, eos_ids=[eos], settings=SW,
                              seed=0, ident="t", round_dir=tmp_path, seen=set(),
                              log=lambda m: None)
    assert "categories" not in rep and kept[0].where == "self-written:round 0:0"
    assert not (tmp_path / CATEGORIES_FILE).exists()
    assert json.loads((tmp_path / "round-0000.json").read_text())["meta"] == \
        {"ident": "t", "seed": 0, "round": 0, "n": 2}


def test_unsteered_spec_fingerprints_are_unchanged():
    # the data-stage fingerprints before data.self_written.categories existed (main at e88395f;
    # tiny then had 96 prompts x 96 new tokens, 64 x 64 since the suite was made faster)
    tiny = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    tiny["data"].update(max_prompts=96, max_new_tokens=96)
    assert parse_spec(tiny, "specs/tiny.yaml").fingerprint("data") == "eb4c7ba94552789d"
    # smollm2-quality's data until round 14 (20.6K prompts; 30.6K since; steered since round
    # 19): the recipe sweeps that pin it still train on that stage (rounds 12-14's
    # dataset.sha256 d2ee1a4f...)
    raw = yaml.safe_load((ROOT / "specs" / "smollm2-quality.yaml").read_text())
    raw["data"]["sources"][0]["count"], raw["data"]["max_prompts"] = 20000, 20600
    del raw["data"]["self_written"]
    assert parse_spec(raw, "q.yaml").fingerprint("data") == "daeb6f5b066a72cd"
    one_ep = {a.arm: a.spec for a in load_sweep(ROOT / "sweeps" / "smollm2-recipe-1ep.yaml").arms}
    assert one_ep["ref"].fingerprint("data") == "daeb6f5b066a72cd"
    raw["data"]["self_written"] = {"categories": ["math"]}
    assert parse_spec(raw, "q.yaml").fingerprint("data") != "daeb6f5b066a72cd"


def test_bad_category_names_the_field():
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["data"]["self_written"] = {"categories": ["writing", "poetry"]}
    with pytest.raises(SpecError, match=r"t.yaml: field 'data.self_written.categories\[1\]': "
                                        r"'poetry' is not one of"):
        parse_spec(raw, "t.yaml")
    raw["data"]["self_written"] = {"categories": ["math", "math"]}
    with pytest.raises(SpecError, match="data.self_written.categories.*non-unique"):
        parse_spec(raw, "t.yaml")
    raw["data"]["self_written"] = {"categories": ["math"]}  # tiny's one source is chatterbot
    with pytest.raises(SpecError, match="field 'data.self_written.categories': steers "
                                        "self-written prompts, but no data source"):
        check_data(parse_spec(raw, "t.yaml"), read_files=False)


def test_steered_rounds_run_through_the_data_stage_engine(tmp_path):
    """The data stage's real engine samples steered candidates (prefixes of several lengths in
    one continuous batch; a random-weight target, so fast, and none is kept: the clear error
    after max_rounds, with the round file written first)."""
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["data"].update(source="self-written", max_prompts=3,
                       self_written={"max_tokens": 8, "max_rounds": 1,
                                     "categories": ["math", "writing", "extraction"]})
    raw["target"].update(model="llama-micro", init="random")
    spec = parse_spec(raw, "specs/t.yaml")
    with pytest.raises(DFlashError, match=r"data.self_written: only 0 of 3 prompts after 1 "):
        data_stage.run(StageContext(spec=spec, results=tmp_path))
    saved = json.loads((tmp_path / "data" / "self_written" / "round-0000.json").read_text())
    assert saved["meta"]["start"] == 0 and saved["meta"]["n"] == 4 == len(saved["tokens"])
    assert all(1 <= len(t) <= 8 for t in saved["tokens"])


def test_data_sweep_arms():
    arms = {a.arm: a.spec for a in load_sweep(ROOT / "sweeps" / "smollm2-data.yaml").arms}
    base = load_spec(ROOT / "specs" / "smollm2-quality.yaml")
    ref, fresh = arms["ref"], arms["fresh-steered"]
    # ref pins round 13's 20.6K prompts (the base has 30.6K since round 14): ~32M tokens, as fresh
    assert ref.fingerprint("data") == "daeb6f5b066a72cd" != base.fingerprint("data")
    assert fresh.fingerprint("data") not in (ref.fingerprint("data"), base.fingerprint("data"))
    assert ref.fingerprint("warmup") == fresh.fingerprint("warmup")  # one shared warm-up
    assert (ref.optim.epochs, fresh.optim.epochs) == (3, 1)
    assert fresh.data.self_written.categories == tuple(CATEGORIES)
    assert fresh.data.max_new_tokens == 512 and fresh.data.samples_per_prompt == 1
    for s in (ref, fresh):
        assert s.bench.protocols == ("dflash",) and s.bench.decode_batches == ()


def test_recipe_1ep_data_arm_is_one_fresh_pass_at_the_ref_arms_budget():
    arms = {a.arm: a.spec for a in load_sweep(ROOT / "sweeps" / "smollm2-recipe-1ep.yaml").arms}
    ref, fresh = arms["ref"], arms["data-steered"]
    assert ref.fingerprint("data") != fresh.fingerprint("data")      # its own data stage
    assert ref.fingerprint("warmup") == fresh.fingerprint("warmup")  # the base's warm-up
    # every other arm but depth8 trains on the base's data stage
    assert {a for a, s in arms.items() if s.fingerprint("data") == ref.fingerprint("data")} == \
        set(arms) - {"data-steered"}
    assert (ref.optim.epochs, fresh.optim.epochs) == (1, 1)
    assert fresh.data.self_written.categories == tuple(CATEGORIES)
    assert (fresh.data.max_new_tokens, fresh.data.samples_per_prompt) == (512, 1)
    # ~ref's 10.70M target tokens at ~364 tokens a sample (the sweep's arithmetic), with the
    # base's 600 chatterbot prompts (the same held-out set as ref's)
    assert fresh.data.max_prompts == 29_400 and abs(29_400 * 364 - 10.70e6) < 0.02 * 10.70e6
    assert [(e.source, e.count) for e in fresh.data.sources] == [
        ("self-written", 28_800), ("chatterbot-corpus", 600)]


def test_dataset_prompt_ids_map_to_their_steered_category(tok, tmp_path, monkeypatch):
    """A mix with the corpus first: the self-written prompts start at prompt_id 3, the data
    manifest records it, and prompt_categories maps every self-written prompt_id (none of the
    corpus's) to the category its text was written for."""
    sample, eos = _writer(tok)
    settings = dataclasses.replace(SW, categories=("math", "writing"), oversample=1.0)

    def writer(spec, tokenizer, count, reject, seen, data_dir):  # the target's sampler stood in
        return write_prompts(count, sample=sample, tokenizer=tokenizer, eos_ids=[eos],
                             settings=settings, seed=spec.seed, ident="t",
                             round_dir=Path(data_dir) / "self_written", seen=seen, reject=reject,
                             log=lambda m: None)
    monkeypatch.setattr(sources, "_self_written", writer)
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    del raw["data"]["source"]
    raw["data"].update(max_prompts=7, samples_per_prompt=2, temperature=0.7, sources=[
        {"source": CHATTERBOT, "count": 3}, {"source": "self-written", "count": 4}])
    spec = parse_spec(raw, "specs/t.yaml")
    samples, _, prompts, per_source = sources.build_samples(spec, tok, tmp_path,
                                                            overlap=eval_overlap)
    assert per_source["self-written"]["first_prompt_id"] == 3
    (tmp_path / "manifest.json").write_text(json.dumps({"sources": per_source}))
    by_id = prompt_categories(tmp_path)
    assert sorted(by_id) == [3, 4, 5, 6]
    for p in prompts:
        want = by_id.get(p.prompt_id)
        assert (want is None) == (p.prompt_id < 3)
        assert want is None or f" {want} request" in p.user_text
    assert {s.prompt_id for s in samples} == set(range(7))
    # unsteered, or a manifest from before first_prompt_id: no categories, no error
    del per_source["self-written"]["first_prompt_id"]
    (tmp_path / "manifest.json").write_text(json.dumps({"sources": per_source}))
    assert prompt_categories(tmp_path) == {}
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DFlashError, match="unreadable data manifest"):
        prompt_categories(tmp_path)
