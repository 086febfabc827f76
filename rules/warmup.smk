# Stage 2: compile every shape bucket on every drafter device once, and record it.
rule warmup:
    input:
        intact=intact("warmup"),  # damaged output -> set aside -> rerun
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/warmup/manifest.json",
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        upstream=upstream("env"),
        fields=spec_params("warmup"),
        code=code_hash("warmup"),
    resources:
        **device_resources(),
    log:
        f"{LOGS}/{{spec}}/warmup.log",
    benchmark:
        f"{BENCHMARKS}/{{spec}}/warmup.tsv",
    shell:
        stage_cmd("warmup")
