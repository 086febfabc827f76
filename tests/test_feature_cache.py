"""The target-feature cache: what is read back equals what the target computed, its budget
refuses what does not fit, and a run with the cache on stays exactly-once and resumes
bit-identically (disk cache, after a simulated kill with a torn write).

Real workers throughout: a random-weight llama-micro target (its FeatureExtractor on CPU),
DFlash drafter replicas through the compile gate (the scheduler tests' fixtures).
"""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_scheduler import SPEC, _dataset

from bench import soft_read
from dflash.cli import main
from dflash.errors import SpecError
from dflash.models.drafter import DFlashConfig
from dflash.models.target_output import (SoftLabels, TargetOutput, soft_positions,
                                         soft_positions_on)
from dflash.spec.load import parse_spec
from dflash.train import checkpoint as ckpt
from dflash.train import budget as run_budget
from dflash.train import cache_budget as cb
from dflash.train import feature_cache as fc
from dflash.train import feature_planes as fp
from dflash.train.packing import bucket_for, pack_row, plan_epoch
from dflash.train.packing import StepMap
from dflash.train.profile import StepProfiler
from dflash.train.scheduler import Pipeline
from dflash.train.workers import buckets, captured, initial_state, make_replicas, make_target_workers


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Replicas, targets and the cache's writer share 2 cores: one intra-op thread each."""


def _spec(cache="host", dtype="target", loss=None, **topology):
    s = dict(SPEC, features={"cache": cache, "dtype": dtype},
             topology={**SPEC["topology"], **topology})
    if loss:
        s["loss"] = {**SPEC["loss"], **loss}
    return parse_spec(s, "cache.yaml")


@dataclasses.dataclass
class DS:
    """The dataset interface the cache reads: sample ids and lengths in index order."""
    samples: list

    @property
    def sample_ids(self):
        return [s[0] for s in self.samples]

    @property
    def lengths(self):
        return [len(s[1]) for s in self.samples]


def _rows(spec, samples, epoch):
    b, bks = spec.batching, buckets(spec)
    lengths = [len(s[1]) for s in samples]
    for batch in plan_epoch(lengths, b.token_budget, b.max_batch_size, spec.seed, epoch):
        yield pack_row([samples[i] for i in batch],
                       bucket_for(sum(lengths[i] for i in batch), bks), 0)


def _cache(spec, samples, folder=None, tensor_values=False, device=None):
    cfg = DFlashConfig.of_spec(spec)
    planes = cb.planes_for(spec, len(cfg.target_layer_ids), cfg.hidden_size)
    return fc.FeatureCache(planes, DS(samples).sample_ids, DS(samples).lengths, folder=folder,
                           ident={"test": 1}, tensor_values=tensor_values, device=device)


def _real_tokens(row):
    return int((row.doc_ids >= 0).sum())


@pytest.mark.parametrize("dtype", ["target", "bfloat16", "float8_e4m3"])
def test_read_back_equals_what_the_target_computed(dtype, tmp_path):
    """Epoch-0 rows written, then read back as the same rows: exact for storage in the target
    dtype, exact after the one rounding for bfloat16, within the stated bound for float8; and
    an epoch-1 row (another packing) read from the cache agrees with the target recomputing it
    up to summation order, with zeros on padding."""
    spec = _spec("disk", dtype)
    samples = _dataset()
    (dev, fn), = make_target_workers(spec.replace(topology={"targets": ["cpu"]}))
    cache = _cache(spec, samples, tmp_path / "fc")
    rows0 = list(_rows(spec, samples, 0))
    computed = [fn(r).features for r in rows0]
    for r, f in zip(rows0, computed):
        cache.write(r, f)
    cache.flush()
    assert all(cache.filled(s[0]) for s in samples)
    groups = spec.target.num_feature_layers
    for r, f in zip(rows0, computed):
        got = cache.read(r, "cpu").features
        n = _real_tokens(r)
        assert got.shape == f.shape and got.dtype == f.dtype
        assert torch.equal(got[0, n:], torch.zeros_like(got[0, n:]))
        x, y = f[0, :n], got[0, :n]
        if dtype == "target":
            assert torch.equal(y, x)
        elif dtype == "bfloat16":
            assert torch.equal(y, x.to(torch.bfloat16).to(x.dtype))
        else:
            scale = x.reshape(n, groups, -1).abs().amax(-1) / fp.FP8_MAX
            bound = torch.maximum(x.abs().reshape(n, groups, -1) / 16,
                                  scale[..., None] / 1024).reshape(n, -1)
            err = (y - x).abs()
            assert (err <= bound * (1 + 1e-6)).all(), float((err - bound).max())
            assert err.max() > 0  # it did quantize
    # a reopened disk cache (same ident) holds the same bytes
    cache.close(remove=False)
    again = _cache(spec, samples, tmp_path / "fc")
    r1 = next(_rows(spec, samples, 1))
    assert again.serves(r1.sample_ids)
    got = again.read(r1, "cpu").features
    ref = fn(r1).features
    n = _real_tokens(r1)
    tol = {"target": 1e-4, "bfloat16": 2e-2, "float8_e4m3": 0.3}[dtype]
    assert torch.allclose(got[0, :n], ref[0, :n], atol=tol, rtol=tol)
    again.close(remove=True)
    assert not (tmp_path / "fc").exists()


def test_soft_labels_travel_whole_through_the_cache():
    """A distilling objective: the target's TargetOutput (features + top-k soft labels at the
    row's response positions) is stored whole and read back equal, positions included, for
    the epoch-0 rows it was written from."""
    spec = _spec("host", loss={"kind": "ce+kd", "kd_top_k": 4})
    samples = _dataset()
    (dev, fn), = make_target_workers(spec.replace(topology={"targets": ["cpu"]}))
    cache = _cache(spec, samples)
    assert set(cache.planes) == {"features", "soft_ids", "soft_logprobs"}
    rows0 = list(_rows(spec, samples, 0))
    outs = [fn(r) for r in rows0]
    for r, o in zip(rows0, outs):
        assert o.soft is not None and o.soft.positions.numel() > 0
        cache.write(r, o)
    cache.flush()
    for r, o in zip(rows0, outs):
        got, n = cache.read(r, "cpu"), _real_tokens(r)
        assert torch.equal(got.features[:, :n], o.features[:, :n])  # padding reads as zeros
        assert torch.equal(got.soft.positions, o.soft.positions)
        assert torch.equal(got.soft.token_ids, o.soft.token_ids)
        assert torch.equal(got.soft.logprobs, o.soft.logprobs)
    cache.close(remove=True)


def test_disk_cache_of_another_run_is_discarded(tmp_path):
    spec = _spec("disk")
    samples = _dataset()
    cache = _cache(spec, samples, tmp_path / "fc")
    row = next(_rows(spec, samples, 0))
    cache.write(row, torch.ones(1, row.input_ids.shape[0], cache.planes["features"].width))
    cache.close(remove=False)
    cfg = DFlashConfig.of_spec(spec)
    planes = cb.planes_for(spec, len(cfg.target_layer_ids), cfg.hidden_size)
    other = fc.FeatureCache(planes, DS(samples).sample_ids, DS(samples).lengths,
                            folder=tmp_path / "fc", ident={"test": 2})
    assert not any(other.filled(s) for s in row.sample_ids)
    other.close(remove=True)


def test_budget_is_tokens_times_layers_times_hidden_times_bytes(tmp_path):
    spec = _spec("host", "bfloat16")
    cfg = DFlashConfig.of_spec(spec)
    ds = DS(_dataset())
    L, H = len(cfg.target_layer_ids), cfg.hidden_size
    b = cb.run_budget(spec, ds, tmp_path, cfg, available=10**12)
    assert b.tokens == sum(ds.lengths) and b.bytes == sum(ds.lengths) * L * H * 2 and b.fits
    f8 = cb.run_budget(_spec("host", "float8_e4m3"), ds, tmp_path, cfg, available=10**12)
    assert f8.bytes == sum(ds.lengths) * (L * H + 4 * L)  # one float32 scale per layer
    # refused up front, naming the field and the figures
    small = cb.run_budget(spec, ds, tmp_path, cfg, available=b.bytes)  # 10 % headroom
    assert not small.fits
    with pytest.raises(SpecError, match=r"field 'features.cache'.*does not fit"):
        cb.check_budget(small, spec.path)
    cb.check_budget(cb.run_budget(spec, ds, tmp_path, cfg, available=2 * b.bytes), spec.path)
    # disk: measured on the cache folder's file system
    assert cb.run_budget(_spec("disk"), ds, tmp_path, cfg).available > 0
    assert cb.run_budget(_spec("off"), ds, tmp_path, cfg) is None


def test_cache_needs_one_node():
    with pytest.raises(SpecError, match=r"features.cache.*topology.nodes 1"):
        _spec("host", nodes=2)


def _pipeline(spec, samples, cache, start_step=0, total_epochs=3, state=None, on_step=None,
              profile_at=None):
    cfg = DFlashConfig.of_spec(spec)
    b, bks = spec.batching, buckets(spec)
    lengths = [len(s[1]) for s in samples]
    step_map = StepMap(lambda e: plan_epoch(lengths, b.token_budget, b.max_batch_size,
                                            spec.seed, e), len(spec.topology.drafters))
    total = step_map.total_for_epochs(total_epochs)
    replicas = make_replicas(spec, cfg, initial_state(cfg, 0), total)
    if state is not None:
        ckpt.load_into(*state, replicas)
    if cache is not None:
        cache.expect(fc.epoch0_samples(step_map, start_step, total))

    def make_row(batch):
        return pack_row([samples[i] for i in batch],
                        bucket_for(sum(lengths[i] for i in batch), bks), 0)

    pipe = Pipeline(target_workers=make_target_workers(spec), replicas=replicas,
                    step_map=step_map, make_row=make_row, start_step=start_step,
                    total_steps=total, seed=0, queue_depth=2, on_step=on_step,
                    feature_cache=cache,
                    profiler=None if profile_at is None else StepProfiler(
                        1, start_step, total, spec.devices(), at=profile_at))
    return pipe, replicas


def test_cached_run_is_exactly_once_and_resumes_bit_identically(tmp_path):
    """Two target workers, three replicas, three epochs, disk cache. Epochs >= 1 run on the
    cache alone (no target forward); every epoch sees each sample once. Then a run killed after
    its checkpoint at step 1 of epoch 0, whose target had run ahead (step 1's rows stored, one
    sample torn: bytes without their commit), resumes from that checkpoint on the cache it left
    and ends with the very weights and per-step samples and losses of the uninterrupted run."""
    spec = _spec("disk")
    samples = _dataset()
    seen: dict[int, tuple] = {}
    cache = _cache(spec, samples, tmp_path / "ref")
    calls = []
    pipe, reps = _pipeline(spec, samples, cache, on_step=lambda r: seen.setdefault(
        r.step, (r.epoch, sorted(r.sample_ids), r.loss)))
    for i, (dev, fn) in enumerate(pipe.targets):
        pipe.targets[i] = (dev, lambda row, fn=fn: calls.append(row.sample_ids) or fn(row))
    pipe.run()
    ids = sorted(s[0] for s in samples)
    by_epoch: dict[int, list] = {}
    for e, sids, _ in seen.values():
        by_epoch.setdefault(e, []).extend(sids)
    assert sorted(by_epoch) == [0, 1, 2]
    assert all(sorted(v) == ids for v in by_epoch.values())
    assert sorted(s for c in calls for s in c) == ids  # the target ran on epoch 0 only
    sm = pipe.step_map
    assert cache.stats["rows_read"] == len(sm.batches(1)) + len(sm.batches(2))
    ref_weights = {k: v.clone() for k, v in reps[0].model.state_dict().items()}
    cache.close(remove=False)

    # the killed run: its own cache folder, a checkpoint after step 0 (epoch 0 has 2 steps)
    assert sm.starts[1] == 2
    folder = tmp_path / "run"
    cache = _cache(spec, samples, folder)
    part, reps = _pipeline(spec, samples, cache)
    part.total_steps = 1
    part.run()
    ckpt.save(tmp_path / "ckpt", 1, reps[0], {}, 2, {"run": 1})
    cache.flush()
    # the target ran ahead: step 1's rows stored, one of their samples torn
    (dev, fn), = make_target_workers(spec.replace(topology={"targets": ["cpu"]}))
    bks = buckets(spec)
    lengths = [len(x[1]) for x in samples]
    ahead = [sm.batches(0)[sm.batch_index(1, r)] for r in range(3)
             if sm.batch_index(1, r) < len(sm.batches(0))]
    for batch in ahead:
        row = pack_row([samples[i] for i in batch], bucket_for(sum(lengths[i] for i in batch),
                                                               bks), 0)
        cache.write(row, fn(row))
    cache.flush()
    victim = ahead[0][0]
    cache.a.t["filled"][victim] = 0
    cache.a.flush()
    cache.close(remove=False)

    cache = _cache(spec, samples, folder)  # the resumed process reopens what was left
    assert int(cache.a.t["filled"].sum()) == len(samples) - 1
    resumed: dict[int, tuple] = {}
    pipe2, reps2 = _pipeline(spec, samples, cache, start_step=1,
                             state=ckpt.latest_good(tmp_path / "ckpt"),
                             on_step=lambda r: resumed.setdefault(
                                 r.step, (r.epoch, sorted(r.sample_ids), r.loss)))
    pipe2.run()
    assert sorted(resumed) == list(range(1, pipe.total_steps))
    for st, rec in resumed.items():
        assert rec == seen[st], st
    for k, v in reps2[0].model.state_dict().items():
        assert torch.equal(v, ref_weights[k]), k
    assert cache.filled(samples[victim][0])
    cache.close(remove=True)


def test_cuda_graph_capture_only_for_a_compiled_cuda_extractor():
    compiled, eager = SimpleNamespace(compile="inductor"), SimpleNamespace(compile=None)
    auto, off = _spec(), parse_spec(dict(SPEC, target={**SPEC["target"], "cuda_graph": "off"}),
                                    "x.yaml")
    assert captured(auto, "cuda:0", compiled)
    assert not captured(auto, "cpu", compiled) and not captured(auto, "cuda:0", eager)
    assert not captured(off, "cuda:0", compiled)


def test_lost_host_cache_after_a_kill_recomputes_and_stays_exactly_once(tmp_path):
    """A host cache dies with its process: a run resumed in epoch 1 finds nothing stored and
    nothing pending, so the target computes every row again; each sample still once an epoch."""
    spec = _spec("host")
    samples = _dataset()
    pipe, reps = _pipeline(spec, samples, None, total_epochs=1)
    pipe.run()  # epoch 0 without a cache: what the killed run had done
    start = pipe.total_steps
    ckpt.save(tmp_path / "ckpt", start, reps[0], {}, 2, {"run": 1})
    cache = _cache(spec, samples)  # the resumed process: an empty host cache
    seen, calls = {}, []
    pipe2, _ = _pipeline(spec, samples, cache, start_step=start,
                         state=ckpt.latest_good(tmp_path / "ckpt"),
                         on_step=lambda r: seen.setdefault(r.epoch, []).extend(r.sample_ids))
    for i, (dev, fn) in enumerate(pipe2.targets):
        pipe2.targets[i] = (dev, lambda row, fn=fn: calls.append(row.sample_ids) or fn(row))
    pipe2.run()
    ids = sorted(s[0] for s in samples)
    assert sorted(seen) == [1, 2] and all(sorted(v) == ids for v in seen.values())
    assert sorted(s for c in calls for s in c) == sorted(ids + ids)  # ran on both epochs
    assert cache.stats["rows_read"] == 0 and not any(cache.filled(s[0]) for s in samples)
    cache.close(remove=True)


def test_validate_prints_the_budget(tmp_path, capsys):
    path = tmp_path / "cachespec.yaml"
    path.write_text(yaml.safe_dump(dict(SPEC, name="cachespec",
                                        features={"cache": "disk", "dtype": "float8_e4m3"})))
    assert main(["validate", str(path), "--no-devices", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "features.cache disk (float8_e4m3): <= " in out and ": fits" in out, out


def test_validate_without_devices_prints_a_gpu_store_unchecked(tmp_path, capsys):
    """A store on a CUDA device that `--no-devices` (or a CPU box) cannot ask: its size is
    printed and the check is left to the train stage, with no traceback (it was
    `AssertionError: Torch not compiled with CUDA enabled` for the recipe sweep's
    device-cache arm)."""
    path = tmp_path / "gpucache.yaml"
    gpu = {"targets": ["cuda:0"], "drafters": ["cuda:0"], "allow_shared_devices": True}
    path.write_text(yaml.safe_dump(dict(SPEC, name="gpucache", topology=gpu,
                                        features={"cache": "device"})))
    assert main(["validate", str(path), "--no-devices", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "features.cache device (target): <= " in out, out
    assert "not checked against cuda:0's free memory" in out, out


def _reference_read(cache, row, key):
    """The per-sample gather the cache did before its one index_select: the stored bytes."""
    src = fp.raw_bytes(cache.a.t[key])
    buf = torch.zeros((row.input_ids.shape[0], src.shape[1]), dtype=src.dtype)
    start = 0
    for s in row.sample_ids:
        i = cache.index[int(s)]
        n = cache.lengths[i]
        buf[start:start + n] = src[cache.offsets[i]:cache.offsets[i] + n]
        start += n
    return buf


def _same_bytes(a, b):
    return a.shape == b.shape and torch.equal(fp.raw_bytes(a).view(torch.uint8),
                                              fp.raw_bytes(b).view(torch.uint8))


@pytest.mark.parametrize("dtype", ["target", "float8_e4m3"])
def test_gather_read_equals_the_per_sample_reference_and_reuses_its_buffers(dtype):
    """Epoch-1 rows (another packing, padded) read with the one gather equal, bit for bit, the
    per-sample copies of the stored bytes (fp8 values and their scales, padding zeros, soft-label
    planes), and once its buffers have grown to the largest row every read reuses the same two
    staging slots."""
    spec = _spec("host", dtype, loss={"kind": "ce+kd", "kd_top_k": 4})
    samples = _dataset()
    cache = _cache(spec, samples)
    g = torch.Generator().manual_seed(0)
    for r in _rows(spec, samples, 0):
        L, p = r.input_ids.shape[0], cache.planes["features"]
        pos = soft_positions(r.doc_ids, r.loss_mask)
        soft = SoftLabels(pos, torch.randint(0, 1000, (pos.numel(), 4), generator=g,
                                             dtype=torch.int32),
                          torch.randn((pos.numel(), 4), generator=g))
        cache.write(r, TargetOutput(torch.randn((1, L, p.width), generator=g).to(p.dtype), soft))
    cache.flush()
    rows1 = list(_rows(spec, samples, 1))
    assert len(rows1) >= 3 and any(_real_tokens(r) < r.input_ids.shape[0] for r in rows1)
    keys = [k for k in cache.a.t if k != "filled"]
    assert ("features.scale" in keys) == (dtype == "float8_e4m3")
    ptrs = []
    for r in rows1 * 3:  # two passes grow both slots to the largest row; the third reuses
        want = {k: _reference_read(cache, r, k) for k in keys}
        got = cache.read(r, "cpu")
        ring = cache._rings["read"]
        assert ring.slots == 2
        ptrs.append(ring.data_ptrs())
        for k in keys:  # the staged bytes of this read, as the ring still holds them
            slot = [b for b in ring._bufs if k in b]
            assert any(_same_bytes(b[k][:r.input_ids.shape[0]], want[k]) for b in slot), k
        f = cache.planes["features"]
        ref = (fp.dequantize(want["features"].view(fc.FP8), want["features.scale"], f.groups,
                             f.dtype) if dtype == "float8_e4m3" else want["features"])
        assert _same_bytes(got.features[0], ref)
        assert torch.equal(got.soft.token_ids, want["soft_ids"][got.soft.positions])
        assert _same_bytes(got.soft.logprobs, want["soft_logprobs"][got.soft.positions])
        n = _real_tokens(r)
        assert not got.features[0, n:].any()  # padding: zeros
        assert got.features.data_ptr() not in ring.data_ptrs()  # the value is not the buffer
    third = ptrs[2 * len(rows1) - 1:]
    assert all(p == third[0] for p in third) and len(third[0]) == 2 * len(keys)
    assert cache._rings["write"].slots <= fc.MAX_PENDING_WRITES
    cache.close(remove=True)


def test_a_profile_window_in_a_cached_epoch_says_where_it_sat():
    """monitor.profile_start inside epoch 1 of a cached run: the summary names the window's step
    and epoch, and counts the rows its target side read from the cache meanwhile."""
    spec = _spec("host")
    samples = _dataset()
    cache = _cache(spec, samples)
    pipe, _ = _pipeline(spec, samples, cache, profile_at=3)  # epoch 0 is steps 0..1
    pipe.run()
    assert pipe.step_map.starts[1] == 2
    s = pipe.profiler.summary()
    assert (s["first_step"], s["last_step"], s["epochs"]) == (3, 3, [1, 1])
    assert isinstance(s["feature_cache_rows_read"], int) and s["feature_cache_rows_read"] >= 0
    assert cache.stats["rows_read"] > 0
    cache.close(remove=True)


ONE_TARGET = {"targets": ["cpu"]}


@pytest.mark.parametrize("dtype", ["target", "float8_e4m3"])
def test_device_store_holds_and_serves_what_the_host_store_does(dtype):
    """features.cache device (here the target's device is the CPU): epoch-0 rows written by
    one index_copy_ per plane, epoch-1 rows (another packing) read by one index_select, equal
    to the host store's bytes on every plane, zeros on padding, soft labels included; no host
    staging ring is ever made."""
    spec = _spec("device", dtype, loss={"kind": "ce+kd", "kd_top_k": 4}, **ONE_TARGET)
    samples = _dataset()
    (dev, fn), = make_target_workers(spec)
    host = _cache(spec.replace(features={"cache": "host", "dtype": dtype}), samples)
    device = _cache(spec, samples, device=dev)
    for r in _rows(spec, samples, 0):
        out = fn(r)
        host.write(r, out)
        device.write(r, out)
    host.flush()
    assert all(device.filled(s[0]) for s in samples) and device.stats["samples_written"] == len(
        samples)
    for k in device.a.t:
        assert _same_bytes(device.a.t[k], host.a.t[k]), k
    for r in _rows(spec, samples, 1):
        assert device.serves(r.sample_ids)
        a, b, n = device.read(r, dev), host.read(r, dev), _real_tokens(r)
        assert torch.equal(a.features, b.features) and not a.features[0, n:].any()
        assert torch.equal(a.soft.positions, b.soft.positions)
        assert torch.equal(a.soft.token_ids, b.soft.token_ids)
        assert torch.equal(a.soft.logprobs, b.soft.logprobs)
    assert device._rings == {} and device.stats["rows_read"] == host.stats["rows_read"]
    with pytest.raises(RuntimeError, match="serves its own device only"):
        device.read(next(_rows(spec, samples, 1)), "meta")
    host.close(remove=True)
    device.close(remove=True)


def test_device_cache_needs_one_target_worker_and_budgets_that_device():
    with pytest.raises(SpecError, match=r"features.cache.*one target worker.*2 target workers"):
        _spec("device")                                  # SPEC has two target workers
    spec = _spec("device", "bfloat16", **ONE_TARGET)
    assert cb.cache_device(spec) == "cpu"
    cfg = DFlashConfig.of_spec(spec)
    ds = DS(_dataset())
    b = cb.run_budget(spec, ds, "unused", cfg, available=10**12)
    assert b.mode == "device" and b.where == "host memory" and b.fits   # the CPU's memory
    assert b.bytes == cb.run_budget(_spec("host", "bfloat16"), ds, "unused", cfg).bytes
    assert "features.cache device (bfloat16)" in b.describe()
    # dflash validate's memory line counts the store on that device (at the spec's upper bound)
    sz = run_budget.sizes(spec)
    assert run_budget._device_cache_memory(sz) == {"cpu": cb.store_bytes(
        spec, sz.samples * sz.sample_tokens, len(cfg.target_layer_ids), cfg.hidden_size)}
    assert run_budget._device_cache_memory(run_budget.sizes(_spec("host"))) == {}


def test_a_run_on_the_device_cache_equals_the_run_on_the_host_cache():
    """The same three epochs with the store on the target's device and on the host: the same
    samples and losses at every step, the same weights, the cache serving epochs 1 and 2."""
    runs = {}
    for mode in ("device", "host"):
        spec = _spec(mode, **ONE_TARGET)
        samples = _dataset()
        cache = _cache(spec, samples, device="cpu" if mode == "device" else None)
        steps = {}
        pipe, reps = _pipeline(spec, samples, cache, on_step=lambda r, steps=steps: steps.setdefault(
            r.step, (r.epoch, sorted(r.sample_ids), r.loss)))
        pipe.run()
        sm = pipe.step_map
        assert cache.stats["rows_read"] == len(sm.batches(1)) + len(sm.batches(2))
        runs[mode] = steps, reps[0].model.state_dict()
        cache.close(remove=True)
    assert runs["device"][0] == runs["host"][0]
    for k, v in runs["device"][1].items():
        assert torch.equal(v, runs["host"][1][k]), k


def test_soft_positions_on_reads_the_rows_host_tensors_and_lands_on_the_device():
    """The kd read's soft positions come from the row's host tensors (no device ``nonzero``:
    round 24's sync) and equal :func:`soft_positions` of the row; on the device asked."""
    spec = _spec("host", "target", loss={"kind": "kd", "kd_top_k": 4})
    samples = _dataset()
    for r in _rows(spec, samples, 0):
        got = soft_positions_on(r, "cpu")
        want = soft_positions(r.doc_ids, r.loss_mask)
        assert got.device.type == "cpu" and torch.equal(got, want) and want.numel() > 0
        # each is a position whose next token answers in the same document
        assert bool((r.loss_mask[want + 1].bool() & (r.doc_ids[want] == r.doc_ids[want + 1])).all())


def test_soft_read_bench_times_every_arm_and_checks_the_kd_reads_agree(tmp_path):
    """bench.soft_read on a small host store: CE's read and both kd reads, queued and synced,
    and its check that host and device positions give the same soft labels."""
    out = tmp_path / "soft_read.json"
    assert soft_read.main(["--store-gb", "0.15", "--rows", "3", "--device", "cpu",
                           "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["ms_per_row"]) == {f"{a}_{m}_ms" for a in ("ce", "kd_device_positions", "kd")
                                      for m in ("queued", "synced")}
    assert all(v > 0 for v in doc["ms_per_row"].values())
    assert doc["row"]["top_k"] == 32 and doc["rows_timed"] == 3
    assert doc["command"].startswith("python -m bench.soft_read --store-gb 0.15")
    # the machine, as every bench script records it (bench.entry.host_facts)
    assert set(doc["host"]) == {"cores", "machine", "torch", "load_avg_1min"}
    assert doc["host"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
