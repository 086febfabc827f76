# Stage 1: build (or adopt) the pinned environment and record it.
rule env:
    input:
        spec=spec_file,
    output:
        f"{RESULTS}/{{spec}}/env/manifest.json",
    params:
        python=python_for,
        lock_sha=lock_sha,  # content of the lock: an edit reruns everything, a touch nothing
        fields=spec_params("env"),
        code=code_hash("env"),
    resources:
        gpu=gpus,
    log:
        f"{LOGS}/{{spec}}/env.log",
    shell:
        stage_cmd("env")
