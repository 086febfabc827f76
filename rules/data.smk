# Stage 3: real prompts -> target-regenerated responses -> token ids (resumable).
rule data:
    input:
        spec=spec_file,
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/data/manifest.json",
    params:
        python=python_for,
        fields=spec_params("data"),
        code=code_hash("data"),
    resources:
        gpu=gpus,
    log:
        f"{LOGS}/{{spec}}/data.log",
    shell:
        stage_cmd("data")
