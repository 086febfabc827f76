"""A damaged input is named where it is found (issue 37): the bench stage run by hand names the
damaged drafter file and the one command that recovers, also after a `snakemake -n` (its
output check, rules/common.smk `intact`) set the train manifest aside."""
from pathlib import Path

import pytest

from dflash.errors import StaleArtifact
from dflash.artifacts.manifest import check_output, set_aside_note, sha256_file, write_manifest
from dflash.spec.load import load_spec
from dflash.stages import StageContext
from dflash.stages.bench import verify_train

SPEC = Path(__file__).with_name("specs") / "micro.yaml"


def _train_tree(root: Path) -> tuple[StageContext, Path, Path]:
    """results/micro/train/: a drafter config and the sealed manifest listing it by sha256."""
    spec = load_spec(SPEC)
    res = root / spec.name
    cfg = res / "train" / "drafter" / "config.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('{"hidden_size": 64}\n')
    mpath = res / "train" / "manifest.json"
    write_manifest(mpath, "train",
                   fingerprints={"env": "env-fp", "train": spec.fingerprint("train"),
                                 "shape": spec.fingerprint("warmup")},
                   files={"drafter/config.json": sha256_file(cfg)})
    return StageContext(spec=spec, results=res, env_fingerprint="env-fp"), cfg, mpath


def test_garbage_drafter_config_named_by_the_stage_run_by_hand(tmp_path):
    ctx, cfg, mpath = _train_tree(tmp_path)
    cfg.write_bytes(b"\x00garbage{{")
    with pytest.raises(StaleArtifact) as e:
        verify_train(ctx)
    msg = str(e.value)
    assert msg.startswith(f"{cfg}: damaged (sha256 ") and "\n" not in msg, msg
    assert msg.endswith("`snakemake --cores all bench_micro`"), msg


def test_garbage_drafter_config_named_after_a_dry_run_set_the_manifest_aside(tmp_path):
    ctx, cfg, mpath = _train_tree(tmp_path)
    cfg.write_bytes(b"\x00garbage{{")
    said = check_output(mpath, "train")  # what `snakemake -n` does before it plans
    assert said and said.startswith(f"{cfg}: damaged (sha256 "), said
    assert not mpath.exists() and mpath.with_name("manifest.json.damaged").is_file()
    with pytest.raises(StaleArtifact) as e:
        verify_train(ctx)  # `dflash bench specs/micro.yaml` afterwards
    msg = str(e.value)
    assert "missing train manifest" not in msg, msg
    assert msg.startswith(f"{cfg}: damaged (sha256 ") and "\n" not in msg, msg
    assert "set aside (as manifest.json.damaged)" in msg, msg
    assert "recover with `snakemake --cores all bench_micro`" in msg, msg


def test_a_stage_that_writes_its_manifest_again_clears_the_note(tmp_path):
    ctx, cfg, mpath = _train_tree(tmp_path)
    cfg.write_bytes(b"garbage")
    check_output(mpath, "train")
    assert set_aside_note(mpath).is_file()
    cfg.write_text('{"hidden_size": 64}\n')
    write_manifest(mpath, "train", fingerprints={}, files={})
    assert not set_aside_note(mpath).exists()
    mpath.unlink()  # gone for another reason: no stale story of the old damage
    with pytest.raises(StaleArtifact, match=r"missing train manifest — run the train stage"):
        verify_train(ctx)
