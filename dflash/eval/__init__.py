"""eval: how good the drafter is. Eval sets, simulated and real τ and its spread over prompts
(spread.py; the decoding itself is decode/'s), the reference implementation's protocol, the
serving comparison, the bench report, and the sweep report over a sweep's arms (sweep_report.py,
`dflash sweep-report`).

May import: the top-level modules, artifacts/, spec/, models/, data/, decode/, runtime/. Nothing
from train/ or stages/.
"""
