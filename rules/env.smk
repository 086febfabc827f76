# Stage 1: build (or adopt) the pinned environment and record it.
rule env:
    input:
        intact=intact("env"),  # damaged output -> set aside -> rerun
    output:
        f"{RESULTS}/{{spec}}/env/manifest.json",
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        lock_sha=lock_sha,  # content of the lock: an edit reruns everything, a touch nothing
        fields=spec_params("env"),
        code=code_hash("env"),
    resources:
        **device_resources(),
    log:
        f"{LOGS}/{{spec}}/env.log",
    benchmark:
        f"{BENCHMARKS}/{{spec}}/env.tsv",
    shell:
        stage_cmd("env")
