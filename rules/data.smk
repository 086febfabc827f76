# Stage 3: real prompts -> target-regenerated responses -> token ids (resumable). One job per
# store key (rules/share.smk): a γ or lr sweep generates its data once.
rule data:
    input:
        intact=intact("data"),  # damaged output -> set aside -> rerun
        env=shared_env("data"),
    output:
        shared_manifest("data"),
    params:
        **shared_params("data"),  # the spec's data fields, code, the env manifest's checksum
    resources:
        **shared_resources("data"),
    log:
        f"{LOGS}/.shared/data-{{key}}.log",
    benchmark:
        f"{BENCHMARKS}/.shared/data-{{key}}.tsv",
    shell:
        shared_stage_cmd("data")
