# Stage 3b: the bench's decoding sweep compiled ahead with a random drafter of the spec's shape,
# into the env's compile cache, beside the data stage; the bench then loads its kernels. Only a
# spec whose bench compiles a sweep on CUDA has this job (decoders_input in rules/common.smk).
rule decoders:
    input:
        intact=intact("decoders"),  # damaged output -> set aside -> rerun
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/decoders/manifest.json",
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        upstream=upstream("env"),
        fields=spec_params("decoders"),
        code=code_hash("decoders"),
    resources:
        **device_resources("decoders"),
    log:
        f"{LOGS}/{{spec}}/decoders.log",
    benchmark:
        f"{BENCHMARKS}/{{spec}}/decoders.tsv",
    shell:
        stage_cmd("decoders")
