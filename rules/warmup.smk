# Stage 2: compile every shape bucket on every drafter device once, and record it.
rule warmup:
    input:
        spec=spec_file,
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/warmup/manifest.json",
    params:
        python=python_for,
        fields=spec_params("warmup"),
        code=code_hash("warmup"),
    resources:
        gpu=gpus,
    log:
        f"{LOGS}/{{spec}}/warmup.log",
    shell:
        stage_cmd("warmup")
