# DFlash drafter training: build pinned env -> warmup compile -> data -> train -> benchmark,
# and beside the data stage the bench's decoders compiled ahead (decoders; CUDA specs only).
# One spec = one experiment (specs/<name>.yaml). Named targets per spec:
#   env_<spec>, warmup_<spec>, data_<spec>, decoders_<spec>, train_<spec>, bench_<spec>
# `snakemake --cores all` runs the default spec (config/config.yaml) through bench.
#
# No conda: or container: directives, on purpose: the env stage is the one environment mechanism.
# It installs (build mode) or verifies (adopt mode, the GPU image) the hash-pinned lock in
# envs/, records it, and every later stage refuses a drifted environment (docs/env.md); a conda
# env or container per rule would be a second, unverified one. `snakemake --lint` flags only
# that (.ci/run checks it).
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"  # the workflow caption of `snakemake --report`


validate(config, "config/config.schema.yaml")  # and fills its defaults


include: "rules/common.smk"
include: "rules/common_share.smk"
include: "rules/share.smk"
include: "rules/env.smk"
include: "rules/warmup.smk"
include: "rules/data.smk"
include: "rules/decoders.smk"
include: "rules/train.smk"
include: "rules/bench.smk"


rule all:
    input:
        default_outputs,
    default_target: True


include: "rules/targets.smk"
include: "rules/sweeps.smk"
