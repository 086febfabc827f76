# Named targets for every spec file: env_<spec>, warmup_<spec>, data_<spec>, train_<spec>,
# bench_<spec>. `snakemake --cores all train_expanded` runs env -> warmup (+ data) -> train.
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
            f"train_{_name}"
        input:
            f"{RESULTS}/{_name}/train/manifest.json",

    rule:
        name:
            f"bench_{_name}"
        input:
            bench_outputs(_name),
