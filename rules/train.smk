# Stage 4: train the drafter with the race-free scheduler; resumes from its last checkpoint.
rule train:
    input:
        intact=intact("train"),  # damaged output -> set aside -> rerun
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
        warmup=f"{RESULTS}/{{spec}}/warmup/manifest.json",
        data=f"{RESULTS}/{{spec}}/data/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/train/manifest.json",
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        upstream=upstream("env", "warmup", "data"),
        fields=spec_params("train"),
        code=code_hash("train"),
    resources:
        **train_resources(),
    log:
        f"{LOGS}/{{spec}}/train.log",
    benchmark:
        f"{BENCHMARKS}/{{spec}}/train.tsv",
    shell:
        stage_cmd("train", launch=True)
