"""The bench's decoders compiled ahead (dflash/stages/decoders.py): the decoders the sweep
builds, the same list for both; a sweep in another process, of a drafter with other weights,
loads every compiled graph from the cache the compile ahead wrote; which specs have the stage
and what reruns it; the GPU share it holds beside the data stage and the warm-up."""
import json
import os
import subprocess
import sys

import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from dflash.artifacts.manifest import read_manifest
from dflash.decode.speculative import verify_width
from dflash.eval.serving import compile_ahead, decoder_plan, sweep
from dflash.models.drafter import DFlashConfig, DFlashDrafter
from dflash.runtime import resources
from dflash.runtime.harness import REPO, copy_workflow, snakemake, units_held
from dflash.spec.load import load_spec
from dflash.spec.types import no_decoders_stage
from dflash.stages import StageContext, decoders, failure_line
from dflash.stages.bench import decoders_ahead
from dflash.train.budget import stage_memory

V, MASK, B, EOS = 96, 95, 5, 93
GB = 10**9


def tiny(weights_seed: int):
    """A 2-layer Llama target (seed 0) and a 1-layer drafter of block 5 whose weights come from
    ``weights_seed``; four prompts."""
    torch.manual_seed(0)
    tc = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, intermediate_size=128, vocab_size=V,
                     eos_token_id=EOS, pad_token_id=EOS)
    target = LlamaForCausalLM(tc).eval().float()
    cfg = DFlashConfig.from_target_config(tc, 1, B, MASK, layer_ids=[0])
    torch.manual_seed(weights_seed)
    drafter = DFlashDrafter(cfg).eval()
    ps = [list(range(3 + s, 9 + 2 * s)) for s in range(4)]
    return target, drafter, ps


def test_the_plan_is_the_sweeps_decoders_in_its_order():
    _, drafter, ps = tiny(0)
    widths = lambda plan: [w for w, _ in plan]  # noqa: E731
    # target-only, the full block, then each other width (16 clipped to the block of 5: a dup)
    plan = decoder_plan(drafter, ps, 2, 8, [EOS], widths=(2, 4, 16))
    assert widths(plan) == [0, 5, 2, 4]
    assert plan[0][1]["drafter"] is None and "verify_tokens" not in plan[0][1]
    assert all(kw["max_len"] == max(map(len, ps)) + 8 and kw["batch"] == 2 for _, kw in plan)
    # a verify narrower than the block first (kw's verify_tokens), then the rest as before
    assert widths(decoder_plan(drafter, ps, 1, 8, [EOS], widths=(2, 4, 16),
                               verify_tokens=3)) == [0, 3, 2, 4, 5]
    assert [verify_width(5), verify_width(5, 1), verify_width(5, 9)] == [5, 2, 5]


def _counters() -> dict:
    return {k: int(v) for k, v in counters["inductor"].items()
            if k.startswith(("fxgraph_cache", "autograd_cache"))} | {
        "graphs": int(counters["stats"]["unique_graphs"])}


def _main(what: str) -> None:
    """One side of the cache test, in its own process: ``ahead`` compiles the sweep's decoders
    (drafter weights seed 0), ``sweep`` times the sweep (seed 1); prints the counters."""
    torch.set_num_threads(1)
    target, drafter, ps = tiny(0 if what == "ahead" else 1)
    args = dict(batches=(2,), min_prompts=2, hf_batches=(), pad_id=EOS, widths=(),
                compile="inductor", log=lambda m: None)
    if what == "ahead":
        rows = compile_ahead(target, drafter, ps, 6, [EOS], **args)
        assert [r["decoder"] for r in rows] == ["target_only", "verify_5"]
    else:
        r = sweep(target, drafter, ps, 6, [EOS], **args)
        assert [w["width"] for w in r["batches"][0]["widths"]] == [5]
    print(json.dumps(_counters()))


def _both_sides(folder: str) -> None:
    """The cache test's two processes, one after the other, on one cache folder under
    ``folder``: each side's counters into ``<side>.json`` there (the background lane runs this
    with the session: ``python -m tests.test_decoders_ahead FOLDER``, ~60 s on 2 cores)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
           "PYTHONPATH": str(REPO)}
    for what in ("ahead", "sweep"):
        r = subprocess.run([sys.executable, "-c", "import sys; from tests.test_decoders_ahead "
                            "import _main; _main(sys.argv[1])", what], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"{what} side failed:\n{r.stderr[-3000:]}")
        with open(os.path.join(folder, f"{what}.json"), "w") as f:
            f.write(r.stdout.strip().splitlines()[-1])


BACKGROUND_CMD = (lambda tmp: tmp, ["-m", "tests.test_decoders_ahead", "{folder}"])


def test_a_sweep_loads_every_graph_the_compile_ahead_wrote(background_cmd):
    """Inductor on CPU, one cache folder: the compile ahead compiles cold (misses); the sweep in
    a fresh process, with other drafter weights, compiles the same graphs and loads each of
    them (no miss): the weights are graph inputs, not constants. (The two processes run in the
    background lane: :func:`_both_sides`.)"""
    folder, rc, out = background_cmd
    assert rc == 0, out[-3000:]
    ahead, swept = (json.loads((folder / f"{w}.json").read_text()) for w in ("ahead", "sweep"))
    assert ahead["graphs"] == swept["graphs"] > 0
    assert ahead.get("fxgraph_cache_miss", 0) > 0
    assert swept.get("fxgraph_cache_miss", 0) == 0 and swept.get("autograd_cache_miss", 0) == 0
    assert swept.get("fxgraph_cache_hit", 0) + swept.get("autograd_cache_hit", 0) \
        >= ahead.get("fxgraph_cache_miss", 0)


def test_which_specs_have_the_stage_and_what_reruns_it():
    quality = load_spec(REPO / "specs" / "smollm2-quality.yaml")
    assert no_decoders_stage(quality) is None
    assert "eagerly" in no_decoders_stage(load_spec(REPO / "tests" / "specs" / "micro.yaml"))
    assert "random target" in no_decoders_stage(load_spec(REPO / "specs" / "expanded.yaml"))
    assert "decode_batches is []" in no_decoders_stage(quality.replace(bench={"decode_batches": []}))
    assert "data stage" in no_decoders_stage(quality.replace(bench={"eval_sets": ["train"]}))
    # the decoders' shapes rerun it; what only training or the data reads does not
    fp = quality.fingerprint("decoders")
    assert quality.replace(bench={"decode_widths": [4, 8]}).fingerprint("decoders") != fp
    assert quality.replace(drafter={"num_layers": 5}).fingerprint("decoders") != fp
    for same in ({"optim": {"lr": 1e-3}}, {"data": {"temperature": 0.7}},
                 {"bench": {"reference_max_new_tokens": 1024}}, {"drafter": {"init": "target-layers"}}):
        assert quality.replace(**same).fingerprint("decoders") == fp, same


def test_run_by_hand_on_a_spec_without_the_stage_it_records_why(tmp_path, monkeypatch):
    """`dflash decoders` on a CPU spec: nothing compiled, the reason and the fingerprints in a
    sealed manifest the bench reads back."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))
    spec = load_spec(REPO / "tests" / "specs" / "micro.yaml")
    ctx = StageContext(spec=spec, results=tmp_path / "micro", env_fingerprint="e" * 16)
    m = decoders.run(ctx)
    assert m["compiled"] == [] and m["failed"] is None and "eagerly" in m["skipped"]
    assert m["workers"] == 0  # no process started
    assert m["fingerprints"] == {"env": "e" * 16, "decoders": spec.fingerprint("decoders")}
    assert read_manifest(tmp_path / "micro" / "decoders" / "manifest.json", "decoders") == m
    assert decoders_ahead(ctx) == {"skipped": m["skipped"], "failed": None, "decoders": 0,
                                   "seconds": m["seconds_total"], "workers": 0,
                                   "same_env": True}


def test_a_failure_the_stage_survives_is_one_line_and_a_traceback_file(tmp_path):
    """What the decoders stage (and the bench's sweep) record instead of raising."""
    try:
        raise RuntimeError("CUDA out of memory\nTried to allocate 2 GiB")
    except RuntimeError as e:
        line = failure_line(e, tmp_path / "decoders" / "error.txt")
        bare = failure_line(e, None)
    assert bare == "RuntimeError: CUDA out of memory"
    assert line == f"{bare} (traceback in {tmp_path / 'decoders' / 'error.txt'})"
    text = (tmp_path / "decoders" / "error.txt").read_text()
    assert text.startswith("Traceback") and "Tried to allocate 2 GiB" in text


def test_the_small_pair_compiles_its_decoders_beside_the_data_stage(tmp_path):
    """One H200: the warm-up, the data stage and the decoders each hold a third of it; train
    and bench hold it whole. A CPU spec's DAG has no decoders job."""
    smol = stage_memory(load_spec(REPO / "specs" / "smollm2-quality.yaml"))
    assert resources.units("decoders", smol["decoders"]["cuda:0"], 141 * GB) == 1
    assert smol["warmup"]["cuda:0"] + smol["data"]["cuda:0"] + smol["decoders"]["cuda:0"] \
        < 0.9 * 141 * GB
    wf = copy_workflow(tmp_path, [REPO / "specs" / "smollm2-quality.yaml",
                                  REPO / "tests" / "specs" / "micro.yaml"])

    def jobs(target, *config):
        r = snakemake(wf, "-n", target, *(("--config", *config) if config else ()))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return units_held(r.stdout + r.stderr)

    got = jobs("bench_smollm2-quality", "gpu_memory_gb=141")
    assert {k: got[k] for k in ("env", "warmup", "data", "decoders", "train", "bench")} == {
        "env": 3, "warmup": 1, "data": 1, "decoders": 1, "train": 3, "bench": 3}
    assert "decoders" not in jobs("bench_micro")


if __name__ == "__main__":
    _both_sides(sys.argv[1])
