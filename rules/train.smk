# Stage 4: train the drafter with the race-free scheduler; resumes from its last checkpoint.
rule train:
    input:
        spec=spec_file,
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
        warmup=f"{RESULTS}/{{spec}}/warmup/manifest.json",
        data=f"{RESULTS}/{{spec}}/data/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/train/manifest.json",
    params:
        python=python_for,
        fields=spec_params("train"),
        code=code_hash("train"),
    resources:
        gpu=gpus,
    log:
        f"{LOGS}/{{spec}}/train.log",
    shell:
        stage_cmd("train")
