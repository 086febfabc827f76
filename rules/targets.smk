# Named targets for every spec file: env_<spec>, warmup_<spec>, data_<spec>, decoders_<spec>,
# train_<spec>, bench_<spec>. `snakemake --cores all train_expanded` runs env -> warmup (+ data) -> train.
for _name in SPECS:

    rule:
        name:
            f"env_{_name}"
        input:
            f"{RESULTS}/{_name}/env/manifest.json",

    rule:
        name:
            f"warmup_{_name}"
        input:
            f"{RESULTS}/{_name}/warmup/manifest.json",

    rule:
        name:
            f"data_{_name}"
        input:
            f"{RESULTS}/{_name}/data/manifest.json",

    rule:
        name:
            f"decoders_{_name}"
        input:
            f"{RESULTS}/{_name}/decoders/manifest.json",

    rule:
        name:
            f"train_{_name}"
        input:
            f"{RESULTS}/{_name}/train/manifest.json",

    rule:
        name:
            f"bench_{_name}"
        input:
            bench_outputs(_name),


# A spec that failed its checks (rules/common.smk, BAD_SPECS) keeps its target names, refused with
# the spec's own error; no other spec is affected. Asked for by name (or by a file under
# results/<spec>/) on the command line, the refusal is one line before the DAG is built; reached
# otherwise (e.g. the default target), the rule's input function refuses it.
for _name in BAD_SPECS:
    for _stage in STAGE_TARGETS:

        rule:
            name:
                f"{_stage}_{_name}"
            input:
                refused(_name),


refuse_requested(command_line_targets())
