# Upstream stages shared by content (dflash/artifacts/sharing.py; functions in rules/common_share.smk):
# the env, warmup and data rules run once per store key, results/.shared/<stage>-<key>/<stage>/;
# `link_stage` makes each spec's results/<spec>/<stage>/ a folder of hard links to it (a local
# job, well under a second), so train and bench read their inputs where they always did.
wildcard_constraints:
    key="[0-9a-f]{16}",


localrules:
    link_stage,


rule link_stage:
    input:
        entry=lambda wc: shared_manifest(wc.stage, link_key(wc)),
        # warmup/data: the spec's env too, so data_<spec> leaves results/<spec>/ as it always did
        env=lambda wc: [] if wc.stage == "env" else f"{RESULTS}/{wc.spec}/env/manifest.json",
    output:
        f"{RESULTS}/{{spec}}/{{stage}}/manifest.json",
    wildcard_constraints:
        stage="|".join(SHARED_STAGES),
    params:
        **link_params(),
    log:
        f"{LOGS}/{{spec}}/{{stage}}.log",  # the stage's own log, linked from the store's
    shell:
        link_cmd()  # a shell job: its params are read when it runs, after the store entry's
