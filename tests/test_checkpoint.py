"""Checkpoints by content and the resume policy (dflash.train.checkpoint), on a tiny real
optimizer state: state.json is part of the checksummed set, and only an unfinished run of the
same run fingerprint (code included) and world size is resumed."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from dflash.errors import SpecError
from dflash.train import checkpoint as ckpt

RUN = {"train": "t1", "shape": "s1", "dataset_sha256": "d1", "code": "c1"}


def replica():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return SimpleNamespace(model=model, opt=opt, params=list(model.parameters()), sched=sched)


@pytest.fixture
def ckpts(tmp_path):
    d = tmp_path / "checkpoints"
    rep = replica()
    for step in (2, 4):
        ckpt.save(d, step, rep, {"tokens": step, "samples": step}, keep=3, run_fingerprint=RUN)
    return d


def decide(d, run=RUN, total=6, nodes=1):
    said = []
    found = ckpt.resume_point(d, run, total, nodes, "specs/x.yaml", log=said.append)
    return found, said


def test_same_run_resumes_the_newest(ckpts):
    (path, state), said = decide(ckpts)
    assert path.name == "step-00000004" and state["step"] == 4 and said == []


def test_an_edited_state_json_is_refused_like_damaged_tensors(ckpts):
    """state.json saying step 1 on step-4 weights: refused, the previous checkpoint used."""
    f = ckpts / "step-00000004" / "state.json"
    f.write_text(f.read_text().replace('"step": 4', '"step": 1'))
    (path, state), said = decide(ckpts)
    assert path.name == "step-00000002" and state["step"] == 2
    assert len(said) == 1 and "step-00000004 is corrupted (state.json checksum mismatch)" in said[0]


def test_checkpoints_of_other_train_code_start_over_saying_why(ckpts):
    found, said = decide(ckpts, {**RUN, "code": "c2"})
    assert found is None and not ckpts.exists()
    assert said == [f"[train] starting over from step 0, checkpoints in {ckpts} discarded: "
                    "the train stage's code changed (code c1 -> c2)"]


def test_a_finished_run_is_trained_again(ckpts):
    """Asked for again (its inputs were redone), a finished run trains its steps again: the
    manifest and the bench report then hold this run's figures, not '0 steps'."""
    found, said = decide(ckpts, total=4)
    assert found is None and "they hold a finished run (step 4/4)" in said[0]


def test_other_world_size_is_refused_naming_the_field(ckpts):
    with pytest.raises(SpecError, match=r"specs/x.yaml: field 'topology.nodes'.*nodes = 1"):
        decide(ckpts, nodes=2)
    assert ckpts.exists()  # nothing discarded


def test_state_json_is_sealed(ckpts):
    state = json.loads((ckpts / "step-00000002" / "state.json").read_text())
    assert state["version"] == ckpt.CKPT_VERSION and len(state["checksum"]) == 64


def test_checkpoint_files_respect_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = ckpt.save(tmp_path / "c", 2, replica(), {}, keep=1, run_fingerprint=RUN)
    finally:
        os.umask(old)
    modes = {f.name: f.stat().st_mode & 0o777 for f in path.iterdir()}
    assert modes == {"model.safetensors": 0o640, "optim.safetensors": 0o640,
                     "state.json": 0o640}, modes


def test_a_checkpoint_written_beside_training_is_the_one_written_in_the_step(tmp_path):
    """The background writer's files equal the synchronous save's, byte for byte, although the
    replica trains on before the write: the snapshot is the step's, not the live tensors."""
    rep = replica()
    want = ckpt.save(tmp_path / "sync", 2, rep, {"tokens": 2}, keep=2, run_fingerprint=RUN)
    w = ckpt.Writer()
    w.save(tmp_path / "async", 2, rep, {"tokens": 2}, keep=2, run_fingerprint=RUN)
    with torch.no_grad():  # the next steps change the weights and moments in place
        for p in rep.params:
            p.add_(1.0)
            rep.opt.state[p]["exp_avg"].add_(1.0)
    got = w.finish()
    w.close()
    assert got.name == want.name == "step-00000002"
    for f in ("model.safetensors", "optim.safetensors"):
        assert (got / f).read_bytes() == (want / f).read_bytes()
    assert json.loads((got / "state.json").read_text()) == \
        json.loads((want / "state.json").read_text())
    (path, state), _ = decide(tmp_path / "async")
    assert path == got and state["step"] == 2


def test_a_failed_background_write_is_raised_at_the_next_save_and_logged_at_close(tmp_path):
    rep = replica()
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the checkpoints go")
    w = ckpt.Writer()
    w.save(blocked, 2, rep, {}, keep=2, run_fingerprint=RUN)  # returns: the write is queued
    with pytest.raises(FileExistsError):
        w.save(tmp_path / "ok", 4, rep, {}, keep=2, run_fingerprint=RUN)
    w.save(blocked, 6, rep, {}, keep=2, run_fingerprint=RUN)
    said = []
    w.close(log=said.append)  # a failed run keeps its own error: this one is only logged
    assert len(said) == 1 and said[0].startswith("[train] the last checkpoint was not written")
