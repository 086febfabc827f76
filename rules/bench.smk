# Stage 5: throughput / MFU / acceptance-length report (JSON, Markdown, plots).
rule bench:
    input:
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
        train=f"{RESULTS}/{{spec}}/train/manifest.json",
    output:
        json=f"{RESULTS}/{{spec}}/bench/report.json",
        md=report(f"{RESULTS}/{{spec}}/bench/report.md", category="Benchmark"),
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        upstream=upstream("env", "train"),
        fields=spec_params("bench"),
        code=code_hash("bench"),
    resources:
        gpu=gpus,
    log:
        f"{LOGS}/{{spec}}/bench.log",
    shell:
        stage_cmd("bench")
