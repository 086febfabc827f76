# DFlash drafter training: build pinned env -> warmup compile -> data -> train -> benchmark.
# One spec = one experiment (specs/<name>.yaml). Named targets per spec:
#   env_<spec>, warmup_<spec>, data_<spec>, train_<spec>, bench_<spec>
# `snakemake --cores all` runs the default spec (config/config.yaml) through bench.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


include: "rules/common.smk"
include: "rules/env.smk"
include: "rules/warmup.smk"
include: "rules/data.smk"
include: "rules/train.smk"
include: "rules/bench.smk"


rule all:
    input:
        bench_outputs(config["default_spec"]),
    default_target: True


include: "rules/targets.smk"
