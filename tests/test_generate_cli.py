"""`dflash generate` on CPU: the micro spec's target with a random drafter exported by dflash's
own export (τ ≈ 1, but every path runs: load, both decodes, the lossless check); bad input is
one clear error naming the file."""
import pytest
import torch

from dflash.cli import main
from dflash.models.drafter import DFlashConfig, DFlashDrafter, export_drafter
from dflash.models.target import hf_config, layer_ids
from dflash.spec.load import load_spec


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, micro_spec):
    spec = load_spec(micro_spec)
    hc = hf_config(spec.target)
    cfg = DFlashConfig.from_target_config(hc, spec.drafter.num_layers, spec.drafter.block_size,
                                          spec.drafter.mask_token_id, layer_ids(spec.target, hc))
    torch.manual_seed(0)
    return export_drafter(DFlashDrafter(cfg), cfg, tmp_path_factory.mktemp("d") / "drafter")


def test_generate_prints_answers_tau_speedup_and_lossless(micro_spec, drafter_dir, capsys):
    assert main(["generate", "--spec", str(micro_spec), "--drafter", str(drafter_dir),
                 "--max-new-tokens", "8", "--batch", "2", "Hello there", "What is 2+2?"]) == 0
    out = capsys.readouterr().out
    assert out.count("> ") >= 2 and "τ 1." in out and "speed-up" in out
    assert "lossless: yes" in out
    # what the adaptive choice served at batch 2, run and timed: every answer still greedy's
    assert "served at batch 2: " in out and "identical to greedy on 2/2 prompts" in out


def test_bad_input_is_one_error_naming_the_file(micro_spec, drafter_dir, tmp_path, capsys):
    assert main(["generate", "--spec", str(micro_spec), "--drafter", str(tmp_path / "none"),
                 "hi"]) != 0
    assert str(tmp_path / "none") in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["generate", "--spec", str(micro_spec), "--drafter", str(drafter_dir),
                 "--prompts", str(empty)]) != 0
    assert f"{empty}: the prompts file has no prompt" in capsys.readouterr().err
