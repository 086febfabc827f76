"""Sharing a GPU between the warm-up, the data stage and the decoders stage
(dflash/runtime/resources.py): the rule, the device memory it reads, the estimates it compares,
and what the DAG's jobs then hold."""
import torch

from dflash.decode.engine import Engine
from dflash.decode.static import round_up
from dflash.models.target import load_target
from dflash.runtime import resources
from dflash.runtime.harness import REPO, copy_workflow, snakemake, units_held
from dflash.spec.load import load_spec
from dflash.train.budget import budget, kv_cache_bytes, render, stage_memory

GB = 10**9


def test_only_a_small_warmup_data_or_decoders_stage_holds_a_third_of_a_device():
    h200 = 141 * GB
    assert resources.units("warmup", 13 * GB, h200) == 1
    assert resources.units("data", int(0.3 * h200), h200) == 1
    assert resources.units("decoders", int(0.3 * h200), h200) == 1
    assert resources.units("data", int(0.3 * h200) + 1, h200) == resources.UNITS
    for measured in ("train", "bench", "env"):  # measurements (and env) always hold it whole
        assert resources.units(measured, 1, h200) == resources.UNITS
    # what is not known keeps the old rule: whole
    assert resources.units("data", None, h200) == resources.UNITS
    assert resources.units("data", 1, None) == resources.UNITS


def test_device_memory_follows_torch_numbering():
    smi = "0, 143771\n1, 81559\n"
    assert resources.parse_device_memory(smi, None) == {"cuda:0": 143771 * 2**20,
                                                        "cuda:1": 81559 * 2**20}
    # CUDA_VISIBLE_DEVICES=1: torch's cuda:0 is the second GPU
    assert resources.parse_device_memory(smi, "1") == {"cuda:0": 81559 * 2**20}
    assert resources.parse_device_memory(smi, "GPU-3f2a") == {}  # by UUID: unknown, no sharing
    assert resources.parse_device_memory("", None) == {}
    assert resources.device_memory(["cuda:0"], 80) == {"cuda:0": 80 * GB}
    assert resources.device_memory(["cuda:0"], 0) == {}  # the config turns sharing off


def test_the_estimates_put_the_small_pair_beside_itself_and_the_8b_warmup_alone_on_80gb():
    smol = stage_memory(load_spec(REPO / "specs" / "smollm2-quality.yaml"))
    big = stage_memory(load_spec(REPO / "specs" / "qwen3-8b-1gpu.yaml"))
    for stage in ("warmup", "data"):
        assert resources.units(stage, smol[stage]["cuda:0"], 141 * GB) == 1
    # the 8B warm-up (~39 GB of training items, x2.3 as round 18 measured the warm-up's peak)
    # holds a whole GPU, an H200's too; its data stage's engine (x1.5 as round 19 measured the
    # data stage's peak) holds a whole 80 GB GPU (over 0.3 of it) but shares an H200
    for gpu in (80 * GB, 150 * GB):
        assert resources.units("warmup", big["warmup"]["cuda:0"], gpu) == resources.UNITS
    assert resources.units("data", big["data"]["cuda:0"], 80 * GB) == resources.UNITS
    assert resources.units("data", big["data"]["cuda:0"], 141 * GB) == 1
    assert big["warmup"]["cuda:0"] > 80 * GB and smol["data"]["cuda:0"] > smol["warmup"]["cuda:0"]
    # round 19's measured peaks of smollm2-quality's recipe (the 8-layer warm-up 9.62 GB, the
    # steered data stage 18.71 GB) are within 10 % of these
    assert abs(smol["warmup"]["cuda:0"] / 9.62e9 - 1) < 0.1
    assert abs(smol["data"]["cuda:0"] / 18.71e9 - 1) < 0.1


def test_the_kv_cache_estimate_is_the_engine_cache():
    """The data stage's estimate counts the engine's static cache as the engine allocates it."""
    spec = load_spec(REPO / "tests" / "specs" / "micro.yaml")
    model = load_target(spec.target, "cpu", spec.seed, need_tokenizer=False).model
    eng = Engine(model, slots=5, max_len=40, max_new_tokens=12, eos_ids=[2], compile=False)
    held = sum(t.numel() * t.element_size() for t in eng.k_rows + eng.v_rows)
    el = torch.empty((), dtype=eng.dtype).element_size()
    assert held == kv_cache_bytes(model.config, 5 + 1, round_up(40, 16), el)


def test_the_dag_shares_a_gpu_only_between_small_warmup_and_data_stages(tmp_path):
    wf = copy_workflow(tmp_path, [REPO / "specs" / "smollm2-quality.yaml",
                                  REPO / "specs" / "qwen3-8b-1gpu.yaml"])

    def held(target, *config):
        r = snakemake(wf, "-n", target, "--config", *config)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return {k: v for k, v in units_held(r.stdout + r.stderr).items() if v is not None}

    assert held("train_smollm2-quality", "gpu_memory_gb=141") == {
        "env": 3, "warmup": 1, "data": 1, "train": 3}
    assert held("train_qwen3-8b-1gpu", "gpu_memory_gb=80") == {   # both alone (above)
        "env": 3, "warmup": 3, "data": 3, "train": 3}
    assert set(held("train_smollm2-quality", "gpu_memory_gb=0").values()) == {3}


def test_validate_says_on_which_gpu_the_warmup_runs_beside_the_data_stage():
    spec = load_spec(REPO / "specs" / "smollm2-quality.yaml")
    m = stage_memory(spec)
    need = max(m["warmup"]["cuda:0"], m["data"]["cuda:0"], m["decoders"]["cuda:0"]) \
        / resources.SHARE_AT_MOST
    lines = [x for x in render(budget(spec)) if "data stage" in x]
    assert lines == [f"  memory cuda:0, data stage: {m['data']['cuda:0'] / 1e9:.2f} GB (the "
                     f"generation engine; beside the warm-up and the decoders stage "
                     f"({m['decoders']['cuda:0'] / 1e9:.2f} GB) on a GPU of >= "
                     f"{need / 1e9:.2f} GB)"]
    # the smallest such GPU is where each holds a third of it
    assert resources.units("data", m["data"]["cuda:0"], need * 1.001) == 1
    assert resources.units("data", m["data"]["cuda:0"], need * 0.99) == resources.UNITS
