"""The house's size limits hold (bench/code_sizes.py): no function over 80 lines and no module
over 450 in dflash/ and bench/; and the check sees a module or a function over its limit."""
from bench.code_sizes import REPO, oversized


def test_no_function_over_80_lines_and_no_module_over_450():
    assert [line for t in ("dflash", "bench") for line in oversized(REPO / t)] == []


def test_an_oversized_function_and_module_are_seen(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (tmp_path / "long_def.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "long_module.py").write_text("x = 1\n" * 451)
    found = oversized(tmp_path)
    assert any("long_def.py:1 f 82 lines > 80" in f for f in found)
    assert any("long_module.py: module 451 lines > 450" in f for f in found)
