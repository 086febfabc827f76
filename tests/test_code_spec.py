"""specs/smollm2-code.yaml (issue #35 item 3): the in-domain code drafter's prompts are written
by the target under the coding cue, decontaminated against HumanEval, and HumanEval is its
headline set."""
from __future__ import annotations

import json
import dataclasses
from pathlib import Path

import pytest

from dflash.data import sources
from dflash.data.self_written import CATEGORIES, CATEGORIES_FILE, user_turn_prefix, write_prompts
from dflash.eval.evalsets import eval_overlap, load_humaneval
from dflash.spec.load import load_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return sources.tokenizer_for("smollm2-135m-instruct")


def test_code_spec_steers_every_self_written_prompt_to_coding():
    code = load_spec(ROOT / "specs" / "smollm2-code.yaml")
    quality = load_spec(ROOT / "specs" / "smollm2-quality.yaml")
    assert code.data.self_written.categories == ("coding",)
    assert "programming question" in CATEGORIES["coding"]
    # its own data stage; the general drafter's recipe, but for the objective and epochs that
    # round 21 measured (CE for 6: the quality spec moved to kd for 8 in round 26, unmeasured
    # here), pinned in the spec
    assert code.fingerprint("data") != quality.fingerprint("data")
    assert (code.loss.kind, code.optim.epochs, quality.loss.kind, quality.optim.epochs) == (
        "ce", 6, "kd", 8)
    assert code.drafter == quality.drafter
    assert dataclasses.replace(code.loss, kind="kd") == quality.loss
    assert dataclasses.replace(code.optim, epochs=8) == quality.optim
    assert code.bench.eval_sets[0] == "humaneval" and "mtbench" in code.bench.eval_sets
    assert code.bench.eval_prompts >= 164  # all of HumanEval, all 80 MT-Bench first turns
    assert code.data.decontaminate_ngram == quality.data.decontaminate_ngram


def test_code_spec_prefixes_carry_the_coding_cue_and_drop_humaneval_copies(tok, tmp_path):
    """Through write_prompts with the code spec's own settings: every candidate the writer is
    given starts with the coding system turn (not the default prefix), every kept prompt is
    recorded as coding, and a candidate copying a HumanEval prompt is dropped."""
    sw = load_spec(ROOT / "specs" / "smollm2-code.yaml").data.self_written
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    copied = load_humaneval(1)[0]
    seen_prefixes = set()

    def sample(prompts, seeds):
        seen_prefixes.update(tuple(p) for p in prompts)
        return [tok(copied if s % 3 == 0 else f"Write a Python function number {s} that "
                    "sorts a list of tuples by their second item.",
                    add_special_tokens=False)["input_ids"] + [eos] for s in seeds]

    def reject(messages):
        return eval_overlap(messages, 8)

    kept, rep = write_prompts(9, sample=sample, tokenizer=tok, eos_ids=[eos], settings=sw,
                              seed=0, ident="code", round_dir=tmp_path, seen=set(),
                              reject=reject, log=lambda m: None)
    coding = tuple(user_turn_prefix(tok, CATEGORIES["coding"]))
    assert seen_prefixes == {coding} != {tuple(user_turn_prefix(tok))}
    assert "programming question" in tok.decode(list(coding))
    saved = json.loads((tmp_path / CATEGORIES_FILE).read_text())
    assert saved["categories"] == ["coding"] * 9 == [p.where.split(":")[1] for p in kept]
    assert rep["filtered"].get("humaneval_overlap", 0) >= 1
    assert all("Python function" in p.user_text for p in kept)
