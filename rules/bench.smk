# Stage 5: throughput / MFU / acceptance-length report (JSON, Markdown, plots).
rule bench:
    input:
        spec=spec_file,
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
        train=f"{RESULTS}/{{spec}}/train/manifest.json",
    output:
        json=f"{RESULTS}/{{spec}}/bench/report.json",
        md=report(f"{RESULTS}/{{spec}}/bench/report.md", category="Benchmark"),
    params:
        python=python_for,
        fields=spec_params("bench"),
        code=code_hash("bench"),
    resources:
        gpu=gpus,
    log:
        f"{LOGS}/{{spec}}/bench.log",
    shell:
        stage_cmd("bench")
