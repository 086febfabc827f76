# Stage 3: real prompts -> target-regenerated responses -> token ids (resumable).
rule data:
    input:
        intact=intact("data"),  # damaged output -> set aside -> rerun
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/data/manifest.json",
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        upstream=upstream("env"),
        fields=spec_params("data"),
        code=code_hash("data"),
    resources:
        **device_resources(),
    log:
        f"{LOGS}/{{spec}}/data.log",
    benchmark:
        f"{BENCHMARKS}/{{spec}}/data.tsv",
    shell:
        stage_cmd("data")
