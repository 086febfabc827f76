"""An exported drafter meets the serving engines' DFlash loader contract
(dflash.models.export_contract), and each way of breaking it is caught and named."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from dflash.errors import DFlashError
from dflash.models.drafter import DFlashConfig, DFlashDrafter, export_drafter
from dflash.models.export_contract import expected_tensors, serving_contract

TARGET = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 6}


@pytest.fixture
def exported(tmp_path):
    cfg = DFlashConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64,
                       rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=96, block_size=4,
                       mask_token_id=95, target_layer_ids=[1, 3], num_target_layers=6)
    return export_drafter(DFlashDrafter(cfg), cfg, tmp_path / "drafter", dtype=torch.bfloat16)


def edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in kw.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_export_meets_the_contract(exported):
    serving_contract(exported)
    serving_contract(exported, TARGET)
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4]     # vLLM: layer id + 1
    # the names the loaders map, exactly: nothing more, nothing less
    assert set(load_file(str(exported / "model.safetensors"))) == set(expected_tensors(cfg))
    # vLLM and SGLang parse config.json as a transformers Qwen3 config

    hf = AutoConfig.from_pretrained(str(exported))
    assert type(hf).__name__ == "Qwen3Config" and hf.block_size == 4
    assert hf.dflash_config == {"mask_token_id": 95, "target_layer_ids": [1, 3]}


@pytest.mark.parametrize("change,named", [
    ({"architectures": ["DFlashDrafter"]}, "architectures"),
    ({"model_type": "llama"}, "model_type"),
    ({"block_size": None}, "block_size"),
    ({"dflash_config": {"mask_token_id": True, "target_layer_ids": [1, 3]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 96, "target_layer_ids": [1, 3]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 6]}}, "target_layer_ids"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3]}, "eagle_aux_hidden_state_layer_ids"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}}, "rope_parameters"),
    ({"dtype": "float32"}, "dtype float32"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_breaches_are_named(exported, change, named):
    edit_config(exported, **change)
    with pytest.raises(DFlashError, match=named):
        serving_contract(exported)


def test_tensor_breaches_are_named(exported):
    path = exported / "model.safetensors"
    sd = load_file(str(path))
    sd["layers.0.self_attn.qproj.weight"] = sd.pop("layers.0.self_attn.q_proj.weight")
    sd["fc.weight"] = sd["fc.weight"][:, :32].contiguous()       # one feature layer, not two
    save_file(sd, str(path))
    with pytest.raises(DFlashError) as e:
        serving_contract(exported)
    msg = str(e.value)
    assert "missing tensor layers.0.self_attn.q_proj.weight" in msg
    assert "unexpected tensor layers.0.self_attn.qproj.weight" in msg
    assert "tensor fc.weight: shape [32, 32], config says [32, 64]" in msg


def test_pairing_with_the_wrong_target_is_named(exported):
    with pytest.raises(DFlashError, match="num_target_layers: 6, the target's num_hidden_layers"):
        serving_contract(exported, {**TARGET, "num_hidden_layers": 30})


def test_unreadable_files_are_one_message(exported):
    (exported / "model.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(DFlashError, match="not a readable safetensors file"):
        serving_contract(exported)
    (exported / "config.json").write_text("{")
    with pytest.raises(DFlashError, match="not readable JSON"):
        serving_contract(exported)
