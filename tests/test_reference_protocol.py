"""The reference harness's τ protocol (dflash/eval/reference.py) and the two aggregation rules,
on the real SmolLM2 target (CPU, float32): the second turn's prompt, the context cap, pooled vs
per-prompt mean by hand, and the train eval set."""
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash.decode.engine import Engine
from dflash.decode.generate import eos_ids_of
from dflash.eval.budget import budget_hits
from dflash.eval.evalsets import load_eval_sets, train_prompts, user_prompt
from dflash.eval.reference import reference_questions, second_turn_prompt
from dflash.eval.tau import greedy_continuations, summarize, target_features, walk_chain
from dflash.models.target import load_target
from dflash.spec.load import load_spec

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Small shapes: one intra-op thread is faster and robust to a busy machine."""


@pytest.fixture(scope="module")
def target():
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    tgt = load_target(spec.target, "cpu")
    return tgt, eos_ids_of(tgt)


def test_second_turn_prompt_holds_the_targets_own_first_answer(target):
    tgt, eos = target
    tok = tgt.tokenizer
    q = reference_questions(1, 0)[0]
    assert len(q["turns"]) == 2 and q["category"] == "writing"
    p1 = user_prompt(tok, q["turns"][0])
    (a1,) = greedy_continuations(tgt.model, [p1], 12, eos)
    p2 = second_turn_prompt(tok, q["turns"], a1)
    # token by token: turn 1's prompt, the answer's own tokens (its eos, if any, is the
    # template's end of turn), the end of turn, then turn 2 as a user turn awaiting the answer
    body = [t for t in a1 if t not in eos]
    assert p2[:len(p1)] == p1
    assert p2[len(p1):len(p1) + len(body)] == body
    end, nl = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n")["input_ids"]
    u2 = user_prompt(tok, q["turns"][1])                # system, user 2, assistant header
    start = tok.convert_tokens_to_ids("<|im_start|>")
    turn2 = u2[[i for i, t in enumerate(u2) if t == start][1]:]   # from "<|im_start|>user"
    assert p2 == p1 + body + [end] + nl + turn2


def test_context_cap_truncates_to_the_greedy_prefix_and_is_counted(target):
    """A prompt whose context leaves 3 positions gets the first 3 tokens of its uncapped greedy
    answer (through the HF loop), the others the engine's full answers; budget_hits counts
    which cap each one stopped at."""

    tgt, eos = target
    short = user_prompt(tgt.tokenizer, "Name a colour.")
    long = user_prompt(tgt.tokenizer, "Write a long story about a dragon who learns to fly.")
    free = greedy_continuations(tgt.model, [short, long], 6, eos)
    eng = Engine(tgt.model, slots=2, max_len=len(long) + 6, max_new_tokens=6, eos_ids=eos)
    ctx = len(long) + 3
    capped = greedy_continuations(tgt.model, [short, long], 6, eos, max_context=ctx, engine=eng)
    assert capped[0] == free[0] and capped[1] == free[1][:3]
    assert eng.stats["answers"] == 1                         # only the short one fitted it
    hits = budget_hits([short, long], capped, 6, eos, ctx)
    assert hits["context"] == 1
    assert hits["max_new_tokens"] == int(len(free[0]) == 6 and free[0][-1] not in eos)
    none_left = greedy_continuations(tgt.model, [long], 6, eos, max_context=len(long))
    assert none_left == [[]] and budget_hits([long], none_left, 6, eos, len(long))["no_room"] == 1


def test_per_prompt_mean_and_pooled_differ_as_computed_by_hand():
    """Prompt A: blocks of 3 and 1 tokens (τ_A = 2); prompt B: one block of 4 (τ_B = 4).
    Pooled: (4 + 4) / (2 + 1) = 8/3; the reference's per-prompt mean: (2 + 4) / 2 = 3."""
    a_cont = [10, 11, 12, 13, 14]
    a = torch.full((4, 3), 99, dtype=torch.long)
    a[0, :2] = torch.tensor([11, 12])                # 2 accepted -> 3 tokens; next anchor 3
    b_cont = [20, 21, 22, 23, 24]
    b = torch.full((4, 3), 99, dtype=torch.long)
    b[0] = torch.tensor([21, 22, 23])                # all 3 accepted -> 4 tokens: done
    ca, cb = walk_chain(a, a_cont), walk_chain(b, b_cont)
    assert ca.produced == [3, 1] and cb.produced == [4]
    s = summarize([ca, cb], 4)
    assert s["tokens"] == 8 and s["forwards"] == 3
    assert s["tau"] == pytest.approx(8 / 3) and s["tau_prompt_mean"] == pytest.approx(3.0)


def test_train_set_is_a_seeded_sample_of_the_distinct_training_prompts(tmp_path):
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    assert train_prompts(spec, tmp_path, 3) == ([], f"no training dataset "
                                                    f"({tmp_path / 'data' / 'dataset.parquet'})")
    prompts = [[1, 2, i] for i in range(6)]
    rows = [p + [7, 8] for p in prompts for _ in range(2)]    # two answers per prompt
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"input_ids": rows, "num_prompt_tokens": [3] * len(rows)}),
                   tmp_path / "data" / "dataset.parquet")
    got, note = train_prompts(spec, tmp_path, 4)
    assert len(got) == 4 and len({tuple(p) for p in got}) == 4 and all(p in prompts for p in got)
    assert "4 of the 6 distinct training prompts" in note
    assert train_prompts(spec, tmp_path, 4)[0] == got                 # the same, run after run
    other = load_spec(REPO / "specs" / "tiny.yaml").replace(seed=1)
    assert train_prompts(other, tmp_path, 4)[0] != got                # seeded by spec.seed
    assert sorted(train_prompts(spec, tmp_path, 100)[0]) == prompts   # all, once each
    (es,) = load_eval_sets(spec, tmp_path, None, ["train"], 4)
    assert es.name == "train" and es.prompts == got


def test_train_set_carries_the_self_written_category_of_each_prompt(tmp_path):
    """prompt_id 0-1 from the corpus (no category), 2-5 self-written and steered (the data
    manifest says they start at 2): each sampled prompt gets its own row's category."""
    spec = load_spec(REPO / "specs" / "tiny.yaml")
    prompts = [[1, 2, i] for i in range(6)]
    cats = ["math", "coding", "math", "writing"]              # prompt_ids 2..5, kept order
    rows = [(pid, p + [7, 8]) for pid, p in enumerate(prompts) for _ in range(2)]
    data = tmp_path / "data"
    (data / "self_written").mkdir(parents=True)
    pq.write_table(pa.table({"prompt_id": [pid for pid, _ in rows],
                             "input_ids": [r for _, r in rows],
                             "num_prompt_tokens": [3] * len(rows)}), data / "dataset.parquet")
    (data / "self_written" / "categories.json").write_text(json.dumps({"categories": cats}))
    (data / "manifest.json").write_text(json.dumps({"sources": {
        "chatterbot-corpus": {"taken": 2}, "self-written": {"kept": 4, "first_prompt_id": 2}}}))
    (es,) = load_eval_sets(spec, tmp_path, None, ["train"], 6)
    assert sorted(es.prompts) == prompts and es.prompts == train_prompts(spec, tmp_path, 6)[0]
    want = {(1, 2, 0): None, (1, 2, 1): None, (1, 2, 2): "math", (1, 2, 3): "coding",
            (1, 2, 4): "math", (1, 2, 5): "writing"}
    assert es.categories == [want[tuple(p)] for p in es.prompts]
    assert "4 carry a self-written category" in es.note
    # unsteered (no categories.json): no categories at all, as before
    (data / "self_written" / "categories.json").unlink()
    (es,) = load_eval_sets(spec, tmp_path, None, ["train"], 6)
    assert es.categories is None


def test_feature_batches_by_tokens_give_the_same_features(target):
    """Long answers: target_features' token budget splits the batches, not the values."""

    tgt, _ = target
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (9, 30, 17, 40)]
    ids = [1, 5, 10]
    whole = target_features(tgt.model, seqs, ids, batch_size=4)
    split = target_features(tgt.model, seqs, ids, batch_size=4, max_tokens=60)   # <= 60 padded
    for w, s, q in zip(whole, split, seqs):
        assert w.shape == s.shape == (len(q), 3 * 576)
        assert torch.allclose(w, s, atol=1e-4, rtol=1e-4)
