"""The one clock behind the stages' ``seconds_by_phase`` and the bench's τ parts."""
import time

from dflash.runtime.clock import PhaseClock


def test_phases_are_contiguous_and_a_skipped_phase_is_none():
    t0 = time.perf_counter()
    clock = PhaseClock()
    time.sleep(0.02)
    clock.end("load")
    clock.skip("reference")  # did not run: None, its time goes to the next phase
    time.sleep(0.01)
    clock.end("sweep")
    wall = time.perf_counter() - t0
    s = clock.seconds
    assert list(s) == ["load_s", "reference_s", "sweep_s"] and s["reference_s"] is None
    assert s["load_s"] >= 0.02 and s["sweep_s"] >= 0.01
    assert s["load_s"] + s["sweep_s"] <= wall + 0.001  # contiguous: no time counted twice
    assert s["load_s"] + s["sweep_s"] <= clock.elapsed() + 0.001  # the whole wall holds them
    assert clock.summary() == f"load {s['load_s']:.1f}s, sweep {s['sweep_s']:.1f}s"
