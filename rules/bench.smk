# Stage 5: throughput / MFU / acceptance-length report (JSON, Markdown, plots).
rule bench:
    input:
        env=f"{RESULTS}/{{spec}}/env/manifest.json",
        train=f"{RESULTS}/{{spec}}/train/manifest.json",
        decoders=decoders_input,  # its decoding sweep compiled ahead (CUDA specs only)
    output:
        json=report(f"{RESULTS}/{{spec}}/bench/report.json", caption="../report/report_json.rst",
                    category="Benchmark", subcategory="{spec}"),
        md=report(f"{RESULTS}/{{spec}}/bench/report.md", caption="../report/report_md.rst",
                  category="Benchmark", subcategory="{spec}"),
        loss=report(f"{RESULTS}/{{spec}}/bench/loss.png", caption="../report/loss.rst",
                    category="Benchmark", subcategory="{spec}"),
        throughput=report(f"{RESULTS}/{{spec}}/bench/throughput.png",
                          caption="../report/throughput.rst", category="Benchmark",
                          subcategory="{spec}"),
        draft_accuracy=report(f"{RESULTS}/{{spec}}/bench/draft_accuracy.png",
                              caption="../report/draft_accuracy.rst", category="Benchmark",
                              subcategory="{spec}"),
        tau_training=report(f"{RESULTS}/{{spec}}/bench/tau_training.png",
                            caption="../report/tau_training.rst", category="Benchmark",
                            subcategory="{spec}"),
        acceptance=report(f"{RESULTS}/{{spec}}/bench/acceptance.png",
                          caption="../report/acceptance.rst", category="Benchmark",
                          subcategory="{spec}"),
        tau_by_category=report(f"{RESULTS}/{{spec}}/bench/tau_by_category.png",
                               caption="../report/tau_by_category.rst", category="Benchmark",
                               subcategory="{spec}"),
        decode_speed=report(f"{RESULTS}/{{spec}}/bench/decode_speed.png",
                            caption="../report/decode_speed.rst", category="Benchmark",
                            subcategory="{spec}"),
    params:
        spec=spec_file,  # a param, not an input: only the fields below decide reruns
        python=python_for,
        upstream=upstream("env", "train"),
        fields=spec_params("bench"),
        code=code_hash("bench"),
    resources:
        **device_resources("bench"),
    log:
        f"{LOGS}/{{spec}}/bench.log",
    benchmark:
        f"{BENCHMARKS}/{{spec}}/bench.tsv",
    shell:
        stage_cmd("bench")
