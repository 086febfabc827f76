"""Prompt sources: chatterbot-corpus, ShareGPT/OpenAI jsonl and parquet, bad-record reporting,
and the MT-Bench / training separation."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from dflash.data.prompts import (
    CHATTERBOT,
    load_prompts,
    normalize,
    parse_conversation,
)
from dflash.data.sources import build_samples
from dflash.errors import DFlashError
from dflash.eval.evalsets import eval_overlap, is_mtbench, mtbench_questions
from dflash.models.target import tokenizer_dir
from dflash.spec.load import parse_spec


def load_mtbench(n=None):
    """First turns of the first ``n`` MT-Bench questions (file order): the one parser's."""
    return [q["text"] for q in mtbench_questions()][:n]

ROOT = Path(__file__).resolve().parents[1]


def write_jsonl(path: Path, records: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_chatterbot_distinct_english_first_turns():
    prompts, report = load_prompts(CHATTERBOT, 10_000, seed=0, max_bad_fraction=0.05)
    texts = [p.user_text for p in prompts]
    assert len(prompts) > 500
    assert len({normalize(t) for t in texts}) == len(texts)  # deduplicated
    assert all(p.messages == [{"role": "user", "content": p.user_text}] for p in prompts)
    assert all(p.where.startswith("chatterbot_corpus/data/english/") for p in prompts)
    assert report.duplicates > 0 and report.total == len(prompts) + report.duplicates + report.bad
    # deterministic for a seed; the first N are a prefix of the first M > N (stable ids)
    again, _ = load_prompts(CHATTERBOT, 96, seed=0, max_bad_fraction=0.05)
    assert [p.user_text for p in again] == texts[:96]
    assert [p.prompt_id for p in again] == list(range(96))
    other, _ = load_prompts(CHATTERBOT, 96, seed=1, max_bad_fraction=0.05)
    assert [p.user_text for p in other] != texts[:96]


def test_sharegpt_and_openai_jsonl(tmp_path):
    src = write_jsonl(tmp_path / "mixed.jsonl", [
        {"conversations": [{"from": "system", "value": "Be brief."},
                           {"from": "human", "value": "What is 2+2?"},
                           {"from": "gpt", "value": "4 (never read)"},
                           {"from": "human", "value": "And 3+3?"}]},
        {"messages": [{"role": "user", "content": "Name a colour."},
                      {"role": "assistant", "content": "Blue."}]},
        "",  # blank lines are not records
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]},
    ])
    prompts, report = load_prompts(str(src), 10, seed=0, max_bad_fraction=0.0)
    assert report.total == 3 and report.bad == 0
    got = sorted((p.messages for p in prompts), key=json.dumps)
    assert got == sorted([
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
    ], key=json.dumps)
    assert {p.where for p in prompts} == {f"{src}:1", f"{src}:2", f"{src}:4"}


def test_parquet(tmp_path):
    path = tmp_path / "chat.parquet"
    recs = [{"conversations": [{"from": "human", "value": f"question {i}"},
                               {"from": "gpt", "value": "answer"}]} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(recs), path)
    prompts, report = load_prompts(str(path), 5, seed=3, max_bad_fraction=0.0)
    assert len(prompts) == 5 and report.total == 20
    assert all(p.where.startswith(f"{path}:row ") for p in prompts)
    assert len({p.user_text for p in prompts}) == 5


def test_bad_records_counted_then_refused(tmp_path):
    good = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(10)]
    bad = [
        "{not json",                                                          # line 11
        {"messages": []},                                                     # 12
        {"messages": [{"role": "wizard", "content": "x"}]},                  # 13
        {"conversations": [{"from": "gpt", "value": "hello"}]},              # 14: no user turn
        {"prompt": "x"},                                                      # 15
        {"messages": [{"role": "user", "content": "x" * 200_000}]},          # 16: too long
        "[1, 2]",                                                             # 17
    ]
    src = write_jsonl(tmp_path / "bad.jsonl", good + bad)
    prompts, report = load_prompts(str(src), 100, seed=0, max_bad_fraction=0.5)
    assert len(prompts) == 10 and report.total == 17 and report.bad == 7
    assert report.counts == {"invalid_json": 1, "empty_conversation": 1, "unknown_role": 1,
                             "no_user_turn": 1, "no_conversation": 1, "too_long": 1,
                             "not_an_object": 1}
    assert report.examples["invalid_json"][0].startswith(f"{src}:11")
    assert report.examples["unknown_role"] == [f"{src}:13 (turn 0 role='wizard')"]
    with pytest.raises(DFlashError) as e:
        load_prompts(str(src), 100, seed=0, max_bad_fraction=0.05)
    msg = str(e.value)
    assert f"first bad record at {src}:11: invalid_json" in msg
    assert "7 of 17 records are bad" in msg and "unknown_role: 1" in msg


def test_parse_conversation_roles():
    assert parse_conversation({"messages": [{"role": "assistant", "content": "hi"}]})[1] == \
        "no_user_turn"
    assert parse_conversation({"messages": [{"role": "user", "content": "  "}]})[1] == \
        "empty_user_text"
    assert parse_conversation({"messages": [{"role": "user", "content": 3}]})[1] == "bad_turn"
    assert parse_conversation({"conversations": [{"from": "gpt", "value": "a"},
                                                 {"from": "system", "value": "b"}]})[1] == \
        "wrong_role_order"
    # ShareGPT roles are OpenAI-invalid and vice versa
    assert parse_conversation({"messages": [{"role": "human", "content": "a"}]})[1] == \
        "unknown_role"


def test_missing_source_and_bad_extension(tmp_path):
    with pytest.raises(DFlashError, match="neither 'chatterbot-corpus' nor"):
        load_prompts(str(tmp_path / "nope.jsonl"), 1, 0, 0.05)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DFlashError, match="unsupported file type"):
        load_prompts(str(tmp_path / "x.csv"), 1, 0, 0.05)


# ---------------------------------------------------------------------------------------------
# MT-Bench: evaluation only
# ---------------------------------------------------------------------------------------------
def test_mtbench_loads():
    qs = load_mtbench()
    assert len(qs) == 80 and all(isinstance(q, str) and q for q in qs)
    assert load_mtbench(3) == qs[:3]


def test_default_source_has_no_mtbench_question():
    """No MT-Bench turn appears among the training prompts of the default spec's source."""
    default = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    assert default["data"]["source"] == CHATTERBOT
    prompts, _ = load_prompts(CHATTERBOT, 10_000, seed=0, max_bad_fraction=0.05)
    train = {normalize(p.user_text) for p in prompts}
    assert not train & {normalize(q) for q in load_mtbench()}
    assert not any(is_mtbench(p.user_text) for p in prompts)


def test_user_file_mtbench_question_dropped_and_counted(tmp_path):
    """The data stage's reject hook drops MT-Bench questions (case/whitespace-insensitive)."""
    q = load_mtbench()[5]
    recs = [{"messages": [{"role": "user", "content": f"ordinary question {i}"}]}
            for i in range(30)]
    recs.insert(7, {"conversations": [{"from": "human", "value": "\n" + q.lower() + "  "}]})
    src = write_jsonl(tmp_path / "user.jsonl", recs)
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["data"].update(source=str(src), max_prompts=1000)
    spec = parse_spec(raw, "specs/tiny.yaml")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama-micro"))
    samples, report, prompts, per_source = build_samples(spec, tok, overlap=eval_overlap)
    assert per_source[str(src)]["taken"] == 30
    assert report.counts == {"mtbench_overlap": 1}
    assert report.examples["mtbench_overlap"] == [f"{src}:8"]
    assert len(prompts) == 30 and not any(is_mtbench(p.user_text) for p in prompts)
    raw["data"]["max_bad_fraction"] = 0.0
    with pytest.raises(DFlashError, match=rf"{src}:8: mtbench_overlap"):
        build_samples(parse_spec(raw, "specs/tiny.yaml"), tok, overlap=eval_overlap)


def test_non_utf8_and_truncated_last_line_are_named_bad_records(tmp_path):
    """Latin-1 bytes are bad records (never U+FFFD in a prompt), a file cut short mid-line is
    'truncated_last_line'; each kind counted with its first file:line (docs/data.md)."""
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}).encode()
             for i in range(10)]
    for i in (2, 5):  # "café" in Latin-1: byte 0xe9
        lines[i] = json.dumps({"messages": [{"role": "user", "content": "caf\u00e9 %d" % i}]},
                              ensure_ascii=False).encode("latin-1")
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n" + lines[0][:25])  # a cut-off 11th line
    prompts, report = load_prompts(str(src), 100, seed=0, max_bad_fraction=0.5)
    assert report.total == 11 and report.bad == 3 and len(prompts) == 8
    assert report.counts == {"not_utf8": 2, "truncated_last_line": 1}
    assert report.examples["not_utf8"][0].startswith(f"{src}:3 (byte 0xe9 at column ")
    assert report.examples["truncated_last_line"][0].startswith(f"{src}:11 ")
    assert not any("\ufffd" in m["content"] for p in prompts for m in p.messages)
    line = report.summary()
    assert line.startswith("3 bad: ") and f"not_utf8 ×2 (first at {src}:3" in line
    assert f"truncated_last_line ×1 (first at {src}:11" in line
    # an unterminated line that is not the last one is still invalid JSON, not truncation
    src.write_bytes(lines[0][:25] + b"\n" + lines[1] + b"\n")
    _, report = load_prompts(str(src), 100, seed=0, max_bad_fraction=0.6)
    assert report.counts == {"invalid_json": 1}
    with pytest.raises(DFlashError, match=rf"first bad record at {src}:1: invalid_json"):
        load_prompts(str(src), 100, seed=0, max_bad_fraction=0.05)
