"""Prompt mixes, target-written prompts (Magpie) and decontamination against MT-Bench/HumanEval."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from dflash.artifacts.manifest import read_manifest
from dflash.data import sources
from dflash.data.prompts import CHATTERBOT, load_prompts
from dflash.data.self_written import check, user_turn_prefix
from dflash.data.sources import tokenizer_for
from dflash.errors import DFlashError, SpecError
from dflash.eval.evalsets import (
    NgramIndex,
    eval_index,
    eval_overlap,
    load_humaneval,
    mtbench_questions,
)
from dflash.spec.load import parse_spec, section_spec
from dflash.stages import StageContext
from dflash.stages import data as data_stage

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dataclasses.replace(section_spec("data", {"source": CHATTERBOT}).self_written,
                               max_chars=200)


def tiny_raw(**data):
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["data"].update(data)
    return raw


def test_user_turn_prefix_is_the_template_up_to_the_user_text():
    tok = tokenizer_for("smollm2-135m-instruct")
    text = tok.decode(user_turn_prefix(tok))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_end|>\n<|im_start|>user\n")


@pytest.mark.parametrize("text,terminated,kind", [
    ("How do I sort a list of tuples by the second item in Python?", True, None),
    ("How do I sort a list of tuples by the second item in Python?", False, "unterminated"),
    ("Explain recursion.<|im_start|>assistant", True, "template_leak"),
    ("Hi there", True, "too_short"),
    ("Tell me " + "about the sea " * 30, True, "too_long"),
    ("Пожалуйста, объясни рекурсию простыми словами.", True, "not_english"),
    ("?? ## !! ** ?? ## !! ** ?? ## !!", True, "not_english"),
    ("What is the the the the the the the the the the the best?", True, "repetitive"),
    ("Why is the sky blue and why are sunsets red" + "!" * 18, True, "repetitive"),
])
def test_self_written_filters(text, terminated, kind):
    assert check(text, terminated, SETTINGS, ["<|im_start|>", "<|im_end|>"]) == kind


def test_ngram_overlap_catches_copies_not_topics():
    mt = [q["text"] for q in mtbench_questions()]
    long_q = next(q for q in mt if len(q.split()) > 30)
    words = long_q.split()
    # a copied span of 8+ words inside other text, with case and punctuation changed
    assert eval_overlap([{"role": "user", "content": "Please help: " + " ".join(
        words[3:14]).upper().replace(",", " ;") + " thanks"}]) == "mtbench_overlap"
    assert eval_overlap([{"role": "user", "content": " ".join(words[3:9])}]) is None  # 6 words
    he = load_humaneval()[10]
    assert eval_overlap([{"role": "user", "content": "Complete this:\n" + he}]) == \
        "humaneval_overlap"
    # a short evaluation turn matches as a whole, not as a topic
    assert eval_overlap([{"role": "user", "content": "prove the pythagorean THEOREM"}]) == \
        "mtbench_overlap"
    assert eval_overlap([{"role": "user", "content": "Who first proved the Pythagorean "
                                                     "theorem, and how?"}]) is None
    # only user turns count
    assert eval_overlap([{"role": "system", "content": long_q},
                         {"role": "user", "content": "hello there"}]) is None
    idx = NgramIndex({"a": ["one two three four five"]}, n=3)
    assert idx.match("x one two three y") == "a" and idx.match("one two x three") is None
    # the chatterbot corpus (the default source) is clean: today's datasets do not change
    prompts, _ = load_prompts(CHATTERBOT, 10_000, 0, 0.05)
    assert not [p.user_text for p in prompts if eval_overlap(p.messages)]
    assert len(eval_index().grams) > 10_000


def test_source_quotas():
    q = sources.source_quotas
    d = lambda sources, n=10: section_spec("data", {"sources": sources, "max_prompts": n})  # noqa
    assert q(d([{"source": "a", "count": 3}, {"source": "b"}, {"source": "c", "weight": 2}])) \
        == [("a", 3), ("b", 2), ("c", 5)]
    assert q(d([{"source": "a", "weight": 1}, {"source": "b", "weight": 1}], 5)) == \
        [("a", 3), ("b", 2)]
    assert q(section_spec("data", {"source": "self-written", "max_prompts": 7})) == \
        [("self-written", 7)]
    with pytest.raises(SpecError, match="data.sources\\[0\\]: give 'count' or 'weight'"):
        q(d([{"source": "a", "count": 3, "weight": 1}]))
    with pytest.raises(SpecError, match="add up to 12, more than data.max_prompts 10"):
        q(d([{"source": "a", "count": 12}]))
    with pytest.raises(SpecError, match="leaving none for the weighted"):
        q(d([{"source": "a", "count": 10}, {"source": "b"}]))
    # weights near the float limit: shares as for equal weights, not a NaN traceback
    assert q(d([{"source": "a", "weight": 1e308}, {"source": "b", "weight": 1e308}], 5)) == \
        [("a", 3), ("b", 2)]
    with pytest.raises(SpecError, match=r"data.sources\[1\]: field 'weight' 1e-09 gives b 0 "
                                        r"of the 10 weighted prompts"):
        q(d([{"source": "a", "weight": 1}, {"source": "b", "weight": 1e-9}]))
    with pytest.raises(SpecError, match="must be a finite number"):
        q(d([{"source": "a", "weight": float("inf")}, {"source": "b"}]))
    with pytest.raises(SpecError, match=r"data.sources\[2\]: field 'source' 'a' is listed "
                                        r"twice \(also data.sources\[0\]\)"):
        q(d([{"source": "a", "count": 2}, {"source": "b"}, {"source": "a"}]))
    with pytest.raises(SpecError, match="give exactly one of 'data.source' or 'data.sources'"):
        parse_spec(tiny_raw(sources=[{"source": "a"}]), "t.yaml")


def _mix_spec(tmp: Path):
    """A real mix on SmolLM2 (CPU, float32): 4 chatterbot + a user file in ``tmp`` (with copies
    of MT-Bench and HumanEval prompts) + 6 prompts the target writes itself. (spec, the file)"""
    mt, he = [q["text"] for q in mtbench_questions()], load_humaneval()
    recs = [{"messages": [{"role": "user", "content": f"Give me a fun fact about the number {i}."}]}
            for i in range(20)]
    recs[3] = {"messages": [{"role": "user", "content": "Quick one: " + mt[7]}]}
    recs[9] = {"messages": [{"role": "user", "content": he[3]}]}
    src = tmp / "user.jsonl"
    if not src.exists():  # the background writes it; the tests read the same file
        src.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    raw = tiny_raw(sources=[{"source": CHATTERBOT, "count": 4}, {"source": str(src)},
                            {"source": "self-written", "count": 6}],
                   max_prompts=14, max_new_tokens=4, max_bad_fraction=0.2,
                   self_written={"max_tokens": 48, "oversample": 1.5})
    del raw["data"]["source"]
    return parse_spec(raw, "specs/mix.yaml"), src


def _in_background(folder: str) -> None:
    """The background command (~20 s on 2 cores): the mix's data stage into ``<folder>/out``."""
    torch.set_num_threads(1)  # as the session's tests run
    spec, _ = _mix_spec(Path(folder))
    data_stage.run(StageContext(spec=spec, results=Path(folder) / "out"))


BACKGROUND_CMD = (lambda tmp: tmp, ["-m", "tests.test_self_written", "{folder}"])


@pytest.fixture(scope="module")
def mixed(background_cmd):
    """The mix the background lane made (tests/conftest.py): (spec, its folder, the user file,
    the data stage's manifest)."""
    folder, rc, out = background_cmd
    assert rc == 0, out[-3000:]
    spec, src = _mix_spec(folder)
    return spec, folder, src, read_manifest(folder / "out" / "data" / "manifest.json", "data")


def test_mix_counts_and_no_eval_overlap(mixed):
    spec, tmp, src, m = mixed
    s = m["sources"]
    assert m["source"] == "mix" and m["counts"]["prompts"] == 14 == m["counts"]["samples"]
    assert s[CHATTERBOT]["taken"] == 4 and s[str(src)]["taken"] == 4
    assert s[str(src)]["bad_by_kind"] == {"mtbench_overlap": 1, "humaneval_overlap": 1}
    sw = s["self-written"]
    assert sw["requested"] == sw["kept"] == 6 and sw["candidates"] >= 9
    assert sw["candidates"] - sw["kept"] >= sum(sw["filtered"].values()) + sw["duplicates"] - 0
    assert sw["engine"] == "fast" and sw["rounds"] >= 1
    assert sw["first_prompt_id"] == 8  # after the corpus's 4 and the file's 4 (data.sources order)
    # the produced training set shares no n-gram with either evaluation set

    tok = tokenizer_for("smollm2-135m-instruct")
    rows = pq.read_table(tmp / "out" / "data" / "dataset.parquet").to_pylist()
    texts = [tok.decode(r["input_ids"][:r["num_prompt_tokens"]], skip_special_tokens=True)
             for r in rows]
    idx = eval_index(spec.data.decontaminate_ngram)
    assert [t for t in texts if idx.match(t)] == []
    # the self-written user turns are real text, distinct from each other and the rest
    users = [t.split("user\n", 1)[1].rsplit("assistant", 1)[0].strip() for t in texts]
    assert len({u.lower() for u in users}) == 14 and all(len(u) >= 12 for u in users)


def test_self_written_rounds_are_reused_on_rerun(mixed):
    spec, tmp, _, m = mixed
    rounds = sorted((tmp / "out" / "data" / "self_written").glob("round-*.json"))
    assert len(rounds) == m["sources"]["self-written"]["rounds"]
    shutil_out = tmp / "out" / "data" / "dataset.parquet"
    shutil_out.unlink()
    (tmp / "out" / "data" / "manifest.json").unlink()
    again = data_stage.run(StageContext(spec=spec, results=tmp / "out"))
    sw = again["sources"]["self-written"]
    assert sw["rounds_reused"] == sw["rounds"] == len(rounds)
    assert again["dataset"]["sha256"] == m["dataset"]["sha256"]
    assert again["generation"]["chunks_resumed"] == again["generation"]["chunks"]


def test_self_written_that_cannot_be_met_fails_clearly(tmp_path):
    """A random-weight model writes no English: a clear error after max_rounds, with counts."""
    raw = tiny_raw(source="self-written", max_prompts=3,
                   self_written={"max_tokens": 8, "max_rounds": 2})
    raw["target"].update(model="llama-micro", init="random")
    spec = parse_spec(raw, "specs/t.yaml")
    with pytest.raises(DFlashError, match=r"data.self_written: only 0 of 3 prompts after 2 "
                                          r"rounds .*unterminated"):
        data_stage.run(StageContext(spec=spec, results=tmp_path))


if __name__ == "__main__":
    _in_background(sys.argv[1])
