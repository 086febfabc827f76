"""The ONE plot list (dflash.eval.report.PLOTS): the bench rule's report outputs are exactly it,
each with its caption, and the default target asks for it (rules/common.smk imports it)."""
from __future__ import annotations

import re
from pathlib import Path

from dflash.eval.report import PLOTS

REPO = Path(__file__).resolve().parents[1]


def test_bench_rule_reports_exactly_the_plot_list_with_captions():
    smk = (REPO / "rules" / "bench.smk").read_text()
    outs = re.findall(r'report\(f"\{RESULTS\}/\{\{spec\}\}/bench/([^"]+)",\s*caption="([^"]+)"', smk)
    pngs = [(name, cap) for name, cap in outs if name.endswith(".png")]
    assert [name for name, _ in pngs] == list(PLOTS)
    for name, cap in pngs:  # captions are relative to rules/
        assert (REPO / "rules" / cap).resolve() == REPO / "report" / f"{name[:-4]}.rst", name
        assert (REPO / "report" / f"{name[:-4]}.rst").stat().st_size > 0, name


def test_default_target_reads_the_plot_list_from_the_report_module():
    common = (REPO / "rules" / "common.smk").read_text()
    assert "from dflash.eval.report import PLOTS" in common
    assert not re.search(r'^PLOTS\s*=', common, re.M)  # not written a second time
