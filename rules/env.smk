# Stage 1: build (or adopt) the pinned environment and record it. One job per store key
# (rules/share.smk): every spec with the same env fields and lock shares it.
rule env:
    input:
        intact=intact("env"),  # damaged output -> set aside -> rerun
    output:
        shared_manifest("env"),
    params:
        **shared_params("env"),  # spec fields, code, lock content (a touch reruns nothing)
    resources:
        **shared_resources("env"),
    log:
        f"{LOGS}/.shared/env-{{key}}.log",
    benchmark:
        f"{BENCHMARKS}/.shared/env-{{key}}.tsv",
    shell:
        shared_stage_cmd("env")
