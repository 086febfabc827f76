"""Which CPU thread torch.profiler gives a CUDA graph's replay (issue #34 item 1): two threads,
each replaying its own captured graph under its own ``dflash.worker/<name>`` label, the
profiler (``profile_all_threads``) started and stopped by the first; prints each thread's OS id
and, per event, torch's thread id, kineto's resource id, the correlation id and the linked op's.
Round 8's run: bench/results/h200/round8-2026-12-02/profile_threads.log.

    python3 bench/gpu/profile_threads.py
"""
import threading

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    x = torch.randn(256, 256, device="cuda")
    graphs = []
    for _ in range(2):
        g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm off the capture, as torch asks
            x @ x
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            x @ x
        graphs.append(g)
    torch.cuda.synchronize()
    native, box, bar = {}, {}, threading.Barrier(2)
    cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)

    def work(name: str, i: int, stopper: bool) -> None:
        native[name] = threading.get_native_id()
        if stopper:  # as StepProfiler: one thread starts and stops it
            box["p"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                               experimental_config=cfg)
            box["p"].start()
        bar.wait()
        for _ in range(2):
            with record_function("dflash.worker/" + name):
                graphs[i].replay()  # inside no torch op, as the workers' replays
                x + 1               # an aten op: its launch is linked to it
        torch.cuda.synchronize()
        bar.wait()
        if stopper:
            box["p"].stop()

    threads = [threading.Thread(target=work, args=("drafter-0", 0, True)),
               threading.Thread(target=work, args=("target-0", 1, False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("torch", torch.__version__, "native", native, "main", threading.get_native_id())
    for e in box["p"].profiler.kineto_results.events():
        n = e.name()
        dev = e.device_type() == torch.autograd.DeviceType.CUDA
        if dev or n.startswith(("dflash", "cuda", "cu", "aten::add")):
            print(f"{n[:34]:34s} dev={int(dev)} tid={e.start_thread_id()} "
                  f"res={e.device_resource_id()} corr={e.correlation_id()} "
                  f"link={e.linked_correlation_id()} t={e.start_ns() % 10**9}")


if __name__ == "__main__":
    main()
