"""The data stage on the fast 'llama-micro' target (random weights, SmolLM2's real tokenizer),
plus one small real-target (SmolLM2-135M-Instruct) generation."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from dflash.cli import main
from dflash.data.chunks import merge_shards, rows_schema, shard_path
from dflash.data.dataset import load_dataset
from dflash.data.prompts import load_prompts, render_prompt
from dflash.errors import DFlashError, StaleArtifact
from dflash.eval.evalsets import mtbench_questions
from dflash.models.target import load_target, tokenizer_dir
from dflash.runtime import faults
from dflash.spec.load import parse_spec
from dflash.stages import StageContext
from dflash.stages import data as data_stage

ROOT = Path(__file__).resolve().parents[1]


def make_spec(**data_overrides):
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["target"].update(model="llama-micro", init="random")
    raw["topology"]["targets"] = data_overrides.pop("targets", ["cpu"])
    raw["data"].update(max_prompts=12, max_new_tokens=8, gen_batch_size=4)
    raw["data"].update(data_overrides)
    return parse_spec(raw, "specs/test.yaml")


def run_data(spec, results, on_shard=None) -> dict:
    ctx = StageContext(spec=spec, results=Path(results))
    if on_shard is None:
        return data_stage.run(ctx)
    with faults.on_shard(on_shard):  # the stage is exactly run(ctx); the hook goes through faults
        return data_stage.run(ctx)


class Recorder:
    """on_shard hook: records generated chunks; optionally raises after ``fail_after`` shards."""

    def __init__(self, fail_after: int | None = None):
        self.chunks: list[int] = []
        self.fail_after = fail_after

    def __call__(self, chunk: int, path: Path) -> None:
        assert path.is_file()  # the shard is complete before the hook runs
        self.chunks.append(chunk)
        if self.fail_after is not None and len(self.chunks) >= self.fail_after:
            raise KeyboardInterrupt("simulated kill")


def read_rows(results: Path) -> list[dict]:
    return pq.read_table(results / "data" / "dataset.parquet").to_pylist()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted greedy run (12 prompts, 3 chunks of 4)."""
    out = tmp_path_factory.mktemp("ref")
    spec = make_spec()
    rec = Recorder()
    manifest = run_data(spec, out, on_shard=rec)
    return spec, out, manifest, rec


def test_dataset_and_manifest(reference, capsys):
    spec, out, m, rec = reference
    assert sorted(rec.chunks) == [0, 1, 2]
    rows = read_rows(out)
    assert [r["sample_id"] for r in rows] == list(range(12))
    assert m["counts"]["prompts"] == 12 and m["counts"]["samples"] == 12
    assert m["counts"]["bad_by_kind"] == {"not_a_conversation": 1}  # one chatterbot entry
    assert m["source"] == "chatterbot-corpus"
    assert m["fingerprints"]["data"] == spec.fingerprint("data")
    t = m["tokens"]
    assert t["response"]["max"] <= 8 and t["prompt"]["max"] <= spec.data.max_prompt_tokens
    assert t["total_tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert m["dataset"]["rows"] == 12 and len(m["dataset"]["sha256"]) == 64
    assert m["generation"]["chunks"] == 3 and m["generation"]["temperature"] == 0.0
    g = m["generation"]
    assert g["engine_requested"] == "auto" and g["engine"] == "fast"
    assert g["engine_settings"]["cpu"]["slots"] == 4 and not g["engine_settings"]["cpu"]["compiled"]
    assert g["new_tokens_generated"] == t["response"]["total"] and g["new_tokens_per_second"] > 0
    # where the stage's seconds went, phase by phase, in the order they ran (the write after
    # the manifest: its log line); the generation phase holds the timed generation
    ph = m["seconds_by_phase"]
    assert list(ph) == ["checks_s", "prompts_s", "plan_s", "generation_s", "merge_s"]
    # each phase is rounded to 3 decimals, the stage's seconds to 2 (a fresh clone's run:
    # phases summing to 1.121 against seconds 1.12)
    assert all(v >= 0 for v in ph.values()) and sum(ph.values()) <= m["seconds"] + 0.01
    assert ph["generation_s"] >= g["generate_seconds"]

    # loss_mask covers exactly the response; the prompt is the chat-templated prompt

    tok = AutoTokenizer.from_pretrained(tokenizer_dir("llama-micro"))
    prompts, _ = load_prompts("chatterbot-corpus", 12, spec.seed, 0.05)
    by_id = {p.prompt_id: p for p in prompts}
    for r in rows:
        P, R = r["num_prompt_tokens"], r["num_response_tokens"]
        assert len(r["input_ids"]) == len(r["loss_mask"]) == P + R
        assert r["loss_mask"] == [0] * P + [1] * R
        assert r["input_ids"][:P] == render_prompt(tok, by_id[r["prompt_id"]].messages)
        assert tok.decode(r["input_ids"][:P]).endswith("<|im_start|>assistant\n")
        eos_at = [i for i, x in enumerate(r["input_ids"][P:]) if x == 2]
        assert eos_at in ([], [R - 1]) and r["stopped_at_eos"] == (eos_at == [R - 1])

    ds = load_dataset(spec, out)
    assert len(ds) == 12 and ds.lengths == [len(r["input_ids"]) for r in rows]
    assert ds.sample(3) == (3, rows[3]["input_ids"], rows[3]["loss_mask"])


def test_resume_after_interruption(reference, tmp_path):
    spec, ref_out, ref_m, _ = reference
    first = Recorder(fail_after=1)
    with pytest.raises(KeyboardInterrupt):
        run_data(spec, tmp_path, on_shard=first)
    shards = sorted((tmp_path / "data" / "shards").glob("part-*.parquet"))
    assert len(shards) == 1 and not (tmp_path / "data" / "dataset.parquet").exists()
    done_ids = set(pq.read_table(shards[0])["sample_id"].to_pylist())

    second = Recorder()
    m = run_data(spec, tmp_path, on_shard=second)
    assert sorted(first.chunks + second.chunks) == [0, 1, 2]  # no chunk generated twice
    assert not set(first.chunks) & set(second.chunks)
    assert m["generation"]["chunks_resumed"] == 1
    regenerated = set()
    for c in second.chunks:
        regenerated |= set(pq.read_table(shard_path(tmp_path / "data" / "shards", c))
                           ["sample_id"].to_pylist())
    assert regenerated == set(range(12)) - done_ids
    assert read_rows(tmp_path) == read_rows(ref_out)
    assert m["dataset"]["sha256"] == ref_m["dataset"]["sha256"]

    # a lost last shard: only its samples are generated again
    (tmp_path / "data" / "shards" / "part-00002.parquet").unlink()
    third = Recorder()
    m3 = run_data(spec, tmp_path, on_shard=third)
    assert third.chunks == [2]
    assert m3["dataset"]["sha256"] == ref_m["dataset"]["sha256"]

    # a corrupt shard is discarded (and said so) and its chunk generated again
    (tmp_path / "data" / "shards" / "part-00001.parquet").write_bytes(b"not parquet")
    fourth = Recorder()
    m4 = run_data(spec, tmp_path, on_shard=fourth)
    assert fourth.chunks == [1]
    assert m4["dataset"]["sha256"] == ref_m["dataset"]["sha256"]


def test_damaged_shard_is_regenerated_and_never_merged(reference, tmp_path, capsys):
    """A shard whose token column changed (sample ids intact, a valid parquet file) is found by
    its checksum at resume (regenerated, said so) and at merge (removed, refused in one line)."""
    spec, _, ref_m, _ = reference
    run_data(spec, tmp_path)
    shard = shard_path(tmp_path / "data" / "shards", 1)

    def tamper():
        t = pq.read_table(shard).to_pylist()
        t[0]["input_ids"][-1] ^= 1  # a one-bit flip in one token
        pq.write_table(pa.Table.from_pylist(t, schema=rows_schema()), shard)

    tamper()
    capsys.readouterr()
    rec = Recorder()
    m = run_data(spec, tmp_path, on_shard=rec)
    out = capsys.readouterr().out
    assert rec.chunks == [1] and m["dataset"]["sha256"] == ref_m["dataset"]["sha256"]
    assert f"discarding shard {shard.name} (damaged: sha256 differs" in out, out
    assert "regenerating it" in out
    # damaged after the resume check: the merge refuses it (naming it) and removes it
    tamper()
    with pytest.raises(DFlashError, match=rf"{shard}: damaged.*generates it again"):
        merge_shards(shard.parent, [None] * 3, [])
    assert not shard.exists()
    rec = Recorder()
    assert run_data(spec, tmp_path, on_shard=rec)["dataset"]["sha256"] == ref_m["dataset"]["sha256"]
    assert rec.chunks == [1]


def test_shards_of_other_generating_code_are_generated_again(reference, tmp_path, capsys,
                                                              monkeypatch):
    spec, _, ref_m, _ = reference
    run_data(spec, tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(data_stage, "stage_code_fingerprint", lambda stage: "other-code")
    rec = Recorder()
    m = run_data(spec, tmp_path, on_shard=rec)
    assert sorted(rec.chunks) == [0, 1, 2]  # every answer generated again
    out = capsys.readouterr().out
    assert "discarding 3 shard(s) made from other inputs (made by other code: the data " \
           "stage's code changed" in out, out
    assert m["dataset"]["sha256"] == ref_m["dataset"]["sha256"]


def test_stale_shards_are_discarded(reference, tmp_path, capsys):
    spec, _, _, _ = reference
    run_data(spec, tmp_path)
    changed = make_spec(max_new_tokens=5)
    rec = Recorder()
    m = run_data(changed, tmp_path, on_shard=rec)
    assert sorted(rec.chunks) == [0, 1, 2]
    assert "discarding 3 shard(s) made from other inputs" in capsys.readouterr().out
    assert m["tokens"]["response"]["max"] <= 5
    with pytest.raises(StaleArtifact, match="fingerprints.data"):
        load_dataset(spec, tmp_path)


def test_hf_engine_gives_the_same_greedy_dataset(reference, tmp_path):
    """engine hf (the batch-by-batch HF loop) and fast agree on greedy answers."""
    spec, _, ref_m, _ = reference
    m = run_data(make_spec(engine="hf"), tmp_path)
    assert m["generation"]["engine"] == "hf" and m["generation"]["engine_settings"] == {}
    assert m["dataset"]["sha256"] == ref_m["dataset"]["sha256"]


def test_sampling_two_devices_deterministic(tmp_path):
    """temperature > 0, 2 samples per prompt, two cpu workers vs one: identical datasets."""
    kw = dict(max_prompts=6, samples_per_prompt=2, temperature=1.0)
    a = run_data(make_spec(targets=["cpu", "cpu"], **kw), tmp_path / "a")
    b = run_data(make_spec(targets=["cpu"], **kw), tmp_path / "b")
    assert a["dataset"]["sha256"] == b["dataset"]["sha256"]
    rows = read_rows(tmp_path / "a")
    assert [(r["sample_id"], r["prompt_id"], r["sample_index"]) for r in rows] == \
        [(p * 2 + k, p, k) for p in range(6) for k in range(2)]
    # the two samples of a prompt share the prompt and (almost surely) differ in the response
    assert sum(rows[2 * p]["input_ids"] != rows[2 * p + 1]["input_ids"] for p in range(6)) >= 5


def test_user_file_mtbench_and_too_long(tmp_path):
    src = tmp_path / "chat.jsonl"
    q = mtbench_questions()[0]["text"]
    lines = [{"messages": [{"role": "user", "content": f"Tell me fact number {i}."}]}
             for i in range(38)]
    lines.append({"conversations": [{"from": "human", "value": "  " + q.upper() + " "}]})
    lines.append({"messages": [{"role": "user", "content": "word " * 500}]})  # > 96 tokens
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    spec = make_spec(source=str(src), max_prompts=100, max_new_tokens=2, gen_batch_size=16)
    m = run_data(spec, tmp_path / "out")
    assert m["counts"]["bad_by_kind"] == {"mtbench_overlap": 1, "too_long": 1}
    assert m["counts"]["bad_examples"]["mtbench_overlap"] == [f"{src}:39"]
    assert m["counts"]["samples"] == 38
    # the same overlap past the threshold is refused, naming the file and line
    strict = make_spec(source=str(src), max_bad_fraction=0.01)
    with pytest.raises(DFlashError, match=rf"{src}:39: mtbench_overlap"):
        run_data(strict, tmp_path / "strict")


def test_cli_reports_errors(tmp_path, capsys):
    spec_file = tmp_path / "broken.yaml"
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["name"] = "broken"
    raw["data"]["source"] = str(tmp_path / "missing.jsonl")
    spec_file.write_text(yaml.safe_dump(raw))
    assert main(["env", str(spec_file), "--results", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["data", str(spec_file), "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "Traceback" not in err


def test_real_smollm2_generation(tmp_path):
    """SmolLM2-135M-Instruct on CPU: 2 prompts, 8 new tokens; matches HF greedy generate."""
    raw = yaml.safe_load((ROOT / "specs" / "tiny.yaml").read_text())
    raw["data"].update(max_prompts=2, max_new_tokens=8, gen_batch_size=2)
    spec = parse_spec(raw, "specs/tiny.yaml")
    m = run_data(spec, tmp_path)
    assert m["counts"]["samples"] == 2
    rows = read_rows(tmp_path)
    tgt = load_target(spec.target, "cpu")
    for r in rows:
        P = r["num_prompt_tokens"]
        ref = tgt.model.generate(torch.tensor([r["input_ids"][:P]]), max_new_tokens=8,
                                 do_sample=False)[0, P:].tolist()
        assert r["input_ids"][P:] == ref[:r["num_response_tokens"]]
        assert tgt.tokenizer.decode(r["input_ids"][P:]).strip()


def test_damaged_dataset_or_manifest_is_set_aside_for_snakemake(reference, tmp_path):
    """A truncated dataset.parquet or an edited data manifest: refused in one line naming the
    file, and the manifest (the data rule's declared output) set aside, so the same Snakemake
    command reruns the data stage; a stale one names the exact command."""
    spec, out, _, _ = reference
    res = tmp_path / "results" / "test"
    shutil.copytree(out / "data", res / "data")
    mpath = res / "data" / "manifest.json"
    ds = res / "data" / "dataset.parquet"
    ds.write_bytes(ds.read_bytes()[:100])
    with pytest.raises(StaleArtifact) as e:
        load_dataset(spec, res)
    msg = str(e.value)
    assert msg.startswith(f"{ds}: damaged (sha256 ") and "\n" not in msg
    assert "so Snakemake reruns the data stage: `snakemake --cores all bench_test`" in msg
    assert not mpath.exists() and mpath.with_name("manifest.json.damaged").is_file()
    # run again by hand after the set-aside: the damaged file itself is named, with the recovery
    with pytest.raises(StaleArtifact) as e:
        load_dataset(spec, res)
    again = str(e.value)
    assert again.startswith(f"{ds}: damaged (sha256 ") and "set aside" in again
    assert "recover with `snakemake --cores all bench_test`" in again

    shutil.copy(out / "data" / "manifest.json", mpath)
    mpath.write_text(mpath.read_text().replace('"seed": 0', '"seed": 1'))
    with pytest.raises(StaleArtifact, match="modified after it was written .* set manifest.json "
                                            "aside"):
        load_dataset(spec, res)
    assert not mpath.exists()

    shutil.copy(out / "data" / "manifest.json", mpath)
    with pytest.raises(StaleArtifact, match=r"fingerprints.data.*rerun the data stage: "
                                            r"`snakemake --cores all --forcerun data bench_test`"):
        load_dataset(make_spec(max_new_tokens=5), res)
    assert mpath.exists()  # stale is not damaged: Snakemake's params decide that rerun
