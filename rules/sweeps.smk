# Sweeps (sweeps/<name>.yaml, dflash/spec/sweeps.py): every arm is a spec (rules/common.smk loads
# them), with the usual env_/warmup_/data_/train_/bench_<sweep>-<arm> targets. Here:
# bench_<sweep> = every arm through bench + the sweep report (one table and plot over the arms,
# results/<sweep>.sweep/report.{json,md} and sweep.png, also in `snakemake --report`).
wildcard_constraints:
    sweep="|".join(SWEEPS) or "no-sweeps",


localrules:
    sweep_report,  # reads JSON, draws one plot: no cluster job


rule sweep_report:
    input:
        reports=arm_files("bench/report.json"),
        train=arm_files("train/manifest.json"),
    output:
        json=f"{RESULTS}/{{sweep}}.sweep/report.json",
        md=report(f"{RESULTS}/{{sweep}}.sweep/report.md", caption="../report/sweep_md.rst",
                  category="Sweeps", subcategory="{sweep}"),
        png=report(f"{RESULTS}/{{sweep}}.sweep/sweep.png", caption="../report/sweep_png.rst",
                   category="Sweeps", subcategory="{sweep}"),
    params:
        sweep=lambda wc: str(SWEEPS[wc.sweep].path.relative_to(workflow.basedir)),
        python=sweep_python,
        arms=sweep_arms,
        code=code_hash("sweep"),
    log:
        f"{LOGS}/{{sweep}}.sweep/report.log",
    shell:
        sweep_report_cmd()


for _sweep in SWEEPS.values():

    rule:
        name:
            f"bench_{_sweep.name}"
        input:
            [f for arm in _sweep.arm_names() for f in bench_outputs(arm)]
            + sweep_report_outputs(_sweep.name),
