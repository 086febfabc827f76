"""The step profile's summary (:func:`summarise`): kineto's events (:func:`events_of`, as
:class:`Ev`) into the figures of ``profile.json`` (docs/benchmarks.md, "The train step under
torch.profiler"). Plain functions over event tuples, so tests build the GPU cases by hand.

Each worker labels its work ``dflash.worker/<name>``; the summary maps each label's thread to
its worker and attributes CPU ops and runtime calls to it. A runtime call's thread is the one
that made it (:func:`on_their_threads`: torch's own thread id for a call outside every torch op,
such as a CUDA graph's replay, is the thread that stopped the profiler). A kernel is attributed
(:func:`_source`) by, first match wins: the CUPTI correlation id of the runtime call that
launched it (every kernel of a graph replay carries its ``cudaGraphLaunch``'s id), the torch op
the profiler links it to, or time overlap with a worker's device span (the profiler's
``gpu_user_annotation`` of the label: first to last kernel of that label on the device; it is
how the compiled target's kernels, launched through the driver API the profiler does not
record, are found). Those device spans are not kernels: they are reported per worker and never
counted in kernel time.

Owns: the summary of one window's events. Imports torch only.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import NamedTuple

import torch

LABEL = "dflash.worker/"
TOP = 15
GAP_US = 10.0  # a device gap longer than this between two kernels is counted as a host gap

# (class, pattern over the lower-cased kernel name), first match wins
KERNEL_CLASSES = [
    ("nccl", r"nccl"),
    ("memcpy/memset", r"memcpy|memset"),
    ("optimizer", r"adam|multi_tensor_apply|foreach"),
    ("attention/flex", r"flash|fmha|attention|attn|flex|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|cublas|nvjet|sm\d+_.*mma|matmul|splitk"),
    ("reduction/softmax", r"softmax|reduce|triton_red_|triton_per_|cross_entropy|nll|norm"),
    ("elementwise/fused triton", r"triton|elementwise|vectorized|unrolled|fill|copy|cat"),
]
CPU_CLASSES = [
    ("nccl", r"nccl|all_reduce|allreduce|c10d"),
    ("memcpy/memset", r"copy_|::to$|_to_copy|contiguous|clone|memcpy|memset|fill_|zero_"),
    ("optimizer", r"optimizer|adam|_foreach"),
    ("attention/flex", r"attention|flex|sdpa|flash"),
    ("gemm", r"::mm$|addmm|bmm|matmul|linear|baddbmm"),
    ("reduction/softmax", r"softmax|sum|mean|amax|max$|logsumexp|cross_entropy|nll|norm"),
    ("elementwise/fused triton", r"^aten::|triton|compiled"),
]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCH = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cudaLaunchCooperative)")
GRAPH_LAUNCH = re.compile(r"^(cudaGraphLaunch|cuGraphLaunch)")
ALLOC = ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaHostAlloc")
MEMORY_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms",
               "allocation.all.allocated", "segment.all.allocated", "segment.all.freed",
               "allocated_bytes.all.peak", "reserved_bytes.all.current")


def classify(name: str, classes: list[tuple[str, str]]) -> str:
    low = name.lower()
    return next((c for c, pat in classes if re.search(pat, low)), "other")


class Ev(NamedTuple):
    """One profiler event, the fields the summary reads (:func:`events_of` makes them from
    kineto's; a test can build device events by hand, which no CPU run records)."""
    name: str
    kind: str      # kineto's activity type: cpu_op, user_annotation, cuda_runtime, kernel, ...
    device: bool   # a device-side (CUDA) event: a kernel, memcpy/memset or a device span
    start_ns: int
    end_ns: int
    thread: int    # torch's id of the CPU thread it started on (device events: unused; a
                   # runtime call's can be wrong: :func:`on_their_threads`)
    corr: int      # torch op: its external id; runtime call and kernel: CUPTI's correlation id
    linked: int    # device event: the external id of the torch op the profiler links it to
    device_index: int
    stream: int    # kineto's resource id: device event, its stream; CPU event, its OS thread


def events_of(raw) -> list[Ev]:
    """kineto's events as :class:`Ev`. torch 2.11's ``_KinetoEvent`` has no ``activity_type``
    (2.13's has): without it the kind is '' and the rules fall back on names (our labels, the
    runtime calls' ``cuda*`` names); a missing link or stream reads 0."""
    cuda = torch.autograd.DeviceType.CUDA
    return [Ev(e.name(), str(_read(e, "activity_type", "")), e.device_type() == cuda,
               e.start_ns(), e.end_ns(), e.start_thread_id(), e.correlation_id(),
               _read(e, "linked_correlation_id", 0), e.device_index(),
               _read(e, "device_resource_id", 0)) for e in raw]


def _read(event, name: str, default):
    """``event.name()`` where this torch's kineto event has that accessor, else ``default``."""
    get = getattr(event, name, None)
    return get() if get is not None else default


def is_label(e: Ev) -> bool:
    """A record_function range (a worker's label or any other), on the host or as its device
    span: time of a range, never an op or a kernel of its own."""
    return e.kind in ("user_annotation", "gpu_user_annotation") or e.name.startswith(LABEL)


def is_runtime(e: Ev) -> bool:
    return not e.device and (e.kind in ("cuda_runtime", "cuda_driver")
                             or e.name.startswith(("cuda", "cu")))


def on_their_threads(cpu: list[Ev]) -> tuple[list[Ev], int]:
    """The CPU events with every runtime call on the thread that made it, and how many moved.

    torch gives a runtime call the thread of the torch op it ran inside; a call inside none (a
    CUDA graph's replay, an event record: under a label, which is no op) gets the thread that
    stopped the profiler (profiler/collection.cpp, ``setKinetoTID``), drafter replica 0's: round
    8's profile credited the target's graph replays to drafter-0. Its resource id is the OS
    thread that made it, as every torch op's of that thread is (measured on the H200:
    bench/results/h200/round8-2026-12-02/profile_threads.log), so that thread's torch id is
    found through it; a call of an OS thread no torch op names keeps torch's."""
    tid = {e.stream: e.thread for e in cpu if e.stream and not is_runtime(e)}
    out = [e._replace(thread=tid[e.stream]) if is_runtime(e) and e.stream in tid else e
           for e in cpu]
    return out, sum(a.thread != b.thread for a, b in zip(cpu, out))


def _self_times(events: list[Ev]) -> dict[int, float]:
    """Self time (ns) of each CPU event, by index: its duration less the part of its direct
    children that lies inside it, on the same thread, never below 0 (events nest per thread,
    but a runtime call's clock can overrun its op's end by a few ns)."""
    by_thread: dict[int, list[int]] = defaultdict(list)
    for i, e in enumerate(events):
        by_thread[e.thread].append(i)
    self_ns: dict[int, float] = {}
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i].start_ns, -(events[i].end_ns - events[i].start_ns)))
        stack: list[int] = []
        for i in idx:
            s, e = events[i].start_ns, events[i].end_ns
            while stack and events[stack[-1]].end_ns <= s:
                stack.pop()
            self_ns[i] = float(e - s)
            if stack:
                self_ns[stack[-1]] -= min(e, events[stack[-1]].end_ns) - s
            stack.append(i)
    return {i: max(0.0, t) for i, t in self_ns.items()}


def _idle(kernels: list[Ev]) -> dict:
    """Per device: busy (union of kernel intervals over all streams), idle between the first
    kernel's start and the last one's end, and the gaps longer than ``GAP_US`` (kernels only:
    a worker's device span covers the gaps inside it)."""
    out = {}
    by_dev: dict[int, list] = defaultdict(list)
    for k in kernels:
        by_dev[k.device_index].append((k.start_ns, k.end_ns))
    for dev, spans in sorted(by_dev.items()):
        spans.sort()
        busy, gaps, gap_ns = 0, 0, 0
        cur_s, cur_e = spans[0]
        for s, e in spans[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                gap_ns += s - cur_e
                gaps += (s - cur_e) / 1e3 > GAP_US
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        span = spans[-1][1] - spans[0][0]
        out[f"cuda:{dev}"] = {"span_s": span / 1e9, "busy_s": busy / 1e9,
                              "busy_fraction": busy / span if span else 0.0,
                              "idle_s": gap_ns / 1e9,
                              "idle_fraction": gap_ns / span if span else 0.0,
                              f"gaps_over_{GAP_US:g}us": gaps}
    return out


def _table(items: dict, total: float, steps: int) -> list[dict]:
    rows = sorted(items.items(), key=lambda kv: -kv[1][1])[:TOP]
    return [{"name": n[:160], "class": c, "calls_per_step": calls / steps, "time_s": t,
             "share": t / total if total else 0.0} for n, (calls, t, c) in rows]


class Links(NamedTuple):
    """What the host side tells about each kernel's origin (:func:`_links`)."""
    runtime: dict  # CUPTI correlation id -> (worker, "graph replay" | "launch")
    ops: dict      # torch op external id -> (worker, op name)
    spans: dict    # device index -> [(start, end, stream, worker)], the workers' device spans


def _links(cpu: list[Ev], device_spans: list[Ev], thread_worker: dict) -> Links:
    runtime, ops = {}, {}
    for e in cpu:
        w = thread_worker.get(e.thread, "other")
        if is_runtime(e) and e.corr:
            runtime[e.corr] = (w, "graph replay" if GRAPH_LAUNCH.match(e.name) else "launch")
        elif e.corr and not is_label(e):
            ops[e.corr] = (w, e.name)
    spans: dict[int, list] = defaultdict(list)
    for s in device_spans:
        if s.name.startswith(LABEL):
            spans[s.device_index].append((s.start_ns, s.end_ns, s.stream, s.name[len(LABEL):]))
    return Links(runtime, ops, spans)


def _source(k: Ev, links: Links) -> tuple[str, str]:
    """(worker, how) for one kernel: the launch call's correlation id (how: "graph replay", or
    the linked torch op's name, or "launch"), else the linked torch op; the worker, when these
    do not name one, is the worker whose device span holds the kernel's midpoint (the same
    stream's first, then the innermost; how: "device span"), else "other"."""
    w, how = "other", "unattributed"
    if k.corr in links.runtime:
        w, how = links.runtime[k.corr]
        if how == "launch" and k.linked in links.ops:
            how = links.ops[k.linked][1]
    elif k.linked in links.ops:
        w, how = links.ops[k.linked]
    if w == "other":
        mid = (k.start_ns + k.end_ns) // 2
        inside = [(st != k.stream, e - s, sw)
                  for s, e, st, sw in links.spans.get(k.device_index, ()) if s <= mid < e]
        if inside:
            w, how = min(inside)[2], how if how != "unattributed" else "device span"
    return w, how


def _kernels(kernels: list[Ev], links: Links, steps: int, workers: dict, syncs: dict) -> dict:
    """The ``device`` section (kernels only), adding each worker's kernel time to ``workers``
    and D2H copies to ``syncs``; each top kernel names its likely source(s)."""
    k_cls: dict[str, float] = {c: 0.0 for c, _ in KERNEL_CLASSES}
    k_cls["other"] = 0.0
    k_rows: dict[str, list] = {}
    k_src: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    for k in kernels:
        t = (k.end_ns - k.start_ns) / 1e9
        cls = classify(k.name, KERNEL_CLASSES)
        k_cls[cls] += t
        row = k_rows.setdefault(k.name, [0, 0.0, cls])
        row[0] += 1
        row[1] += t
        w, how = _source(k, links)
        workers[w]["kernel_s"] += t
        if how == "graph replay":
            workers[w]["graph_replay_kernel_s"] += t
        k_src[k.name][f"{w}: {how}"] += t
        if re.search(r"memcpy.*(dtoh|device -> (pinned|pageable))", k.name.lower()):
            syncs["memcpy_d2h"]["count"] += 1
            syncs["memcpy_d2h"]["time_s"] += t
    k_total = sum(k_cls.values())
    top = _table(k_rows, k_total, steps)
    for r, name in zip(top, sorted(k_rows, key=lambda n: -k_rows[n][1])):
        src = sorted(k_src[name].items(), key=lambda kv: -kv[1])
        r.update(source=src[0][0], sources=dict(src[:3]))
    return {"kernel_time_s": k_total, "kernel_time_s_by_class": k_cls,
            "kernel_time_s_per_step": k_total / steps, "kernels_per_step": len(kernels) / steps,
            "top_kernels": top, "host_gaps": _idle(kernels) if kernels else {}}


def _cpu(cpu: list[Ev], thread_worker: dict, steps: int, workers: dict, syncs: dict) -> dict:
    """The host side: CPU op self time by class and the top ops, runtime calls (launches,
    syncs, allocator), per worker; labels are ranges, not ops, and count in none of it."""
    self_ns = _self_times(cpu)
    cpu_cls: dict[str, float] = defaultdict(float)
    cpu_ops: dict[str, list] = {}
    alloc = {n: 0 for n in ALLOC}
    launches = {"kernel": 0, "graph": 0}
    for i, e in enumerate(cpu):
        name, w = e.name, thread_worker.get(e.thread, "other")
        if is_label(e):
            continue
        if name in SYNCS:
            syncs[name]["count"] += 1
            syncs[name]["time_s"] += (e.end_ns - e.start_ns) / 1e9
        if name in alloc:
            alloc[name] += 1
        kind = "kernel" if LAUNCH.match(name) else "graph" if GRAPH_LAUNCH.match(name) else None
        if kind:
            launches[kind] += 1
            workers[w][f"{kind}_launches"] += 1
        t = self_ns[i] / 1e9
        cls = "cuda runtime" if is_runtime(e) else classify(name, CPU_CLASSES)
        cpu_cls[cls] += t
        workers[w]["cpu_op_s"] += t
        row = cpu_ops.setdefault(name, [0, 0.0, cls])
        row[0] += 1
        row[1] += t
    return {"launches": {k: v / steps for k, v in launches.items()}, "alloc": alloc,
            "cpu": {"op_time_s_by_class": dict(cpu_cls),
                    "top_ops": _table(cpu_ops, sum(cpu_cls.values()), steps)}}


def summarise(events: list[Ev], steps: int, first: int, activities: list[str], before: dict,
              after: dict, wall_s: float | None = None) -> dict:
    """The profile summary from the profiler's events (see docs/benchmarks.md)."""
    cpu, moved = on_their_threads([e for e in events if not e.device])
    device = [e for e in events if e.device]
    kernels = [e for e in device if not is_label(e)]
    spans = [e for e in device if is_label(e)]
    thread_worker = {e.thread: e.name[len(LABEL):] for e in cpu if e.name.startswith(LABEL)}
    workers: dict[str, dict] = defaultdict(lambda: dict(EMPTY_WORKER))
    for s in spans:
        if s.name.startswith(LABEL):
            workers[s.name[len(LABEL):]]["device_span_s"] += (s.end_ns - s.start_ns) / 1e9
    syncs = {n: {"count": 0, "time_s": 0.0} for n in (*SYNCS, "memcpy_d2h")}
    host = _cpu(cpu, thread_worker, steps, workers, syncs)
    dev = _kernels(kernels, _links(cpu, spans, thread_worker), steps, workers, syncs)
    # what a summary that counted the labels' device spans as kernels would have added
    dev["label_spans_s_not_counted"] = sum(s.end_ns - s.start_ns for s in spans) / 1e9
    host["cpu"]["runtime_calls_rethreaded"] = moved
    return {
        "steps": steps, "first_step": first, "activities": activities, "wall_s": wall_s,
        "device": dev,
        "launches_per_step": host["launches"],
        "syncs": {n: {**v, "per_step": v["count"] / steps} for n, v in syncs.items()},
        "allocator": {"calls": host["alloc"], "memory_stats_delta": {
            d: {k: after["memory"][d].get(k, 0) - before["memory"][d].get(k, 0)
                for k in MEMORY_KEYS} for d in after.get("memory", {})}},
        "cpu": host["cpu"],
        "workers": _workers(workers, before, after, steps),
        "note": "one process-wide torch.profiler over whole steps of every worker; CPU op "
                "times are self times; labels (record_function ranges) are neither ops nor "
                "kernels: a worker's device span is its first to last kernel on the device; "
                "kernels are attributed by their launch call's correlation id (graph replays: "
                "the cudaGraphLaunch's; a call counts on the OS thread that made it), else "
                "their linked op, else the device span that holds them; busy/wait are the "
                "scheduler's own timers over the same steps, as collected at the window's ends "
                "(CUDA event pairs still pending then count in the next step)",
    }


EMPTY_WORKER = {"cpu_op_s": 0.0, "kernel_s": 0.0, "graph_replay_kernel_s": 0.0,
                "device_span_s": 0.0, "kernel_launches": 0, "graph_launches": 0}


def _workers(found: dict, before: dict, after: dict, steps: int) -> dict:
    """Per worker: what the profiler attributed to it, and its busy and wait over the window
    (None for "other": the work of threads that are no worker, e.g. the main thread's)."""
    out = {}
    for n in sorted(set(found) | set(after.get("busy", {}))):
        row = {**EMPTY_WORKER, **found.get(n, {}), "busy_s_per_step": None,
               "wait_s_per_step": None, "busy_fraction": None}
        if n in after.get("busy", {}):
            busy = after["busy"][n] - before.get("busy", {}).get(n, 0.0)
            wait = after["wait"].get(n, 0.0) - before.get("wait", {}).get(n, 0.0)
            row.update(busy_s_per_step=busy / steps, wait_s_per_step=wait / steps,
                       busy_fraction=busy / (busy + wait) if busy + wait > 0 else None)
        out[n] = row
    return out
