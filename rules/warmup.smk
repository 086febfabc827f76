# Stage 2: compile every shape bucket on every drafter device once, and record it. One job per
# store key (rules/share.smk): specs that differ in training fields only share it.
rule warmup:
    input:
        intact=intact("warmup"),  # damaged output -> set aside -> rerun
        env=shared_env("warmup"),
    output:
        shared_manifest("warmup"),
    params:
        **shared_params("warmup"),  # the spec's shape fields, code, the env manifest's checksum
    resources:
        **shared_resources("warmup"),
    log:
        f"{LOGS}/.shared/warmup-{{key}}.log",
    benchmark:
        f"{BENCHMARKS}/.shared/warmup-{{key}}.tsv",
    shell:
        shared_stage_cmd("warmup")
