# Functions of the shared stores and sweeps (rules/share.smk, rules/sweeps.smk): upstream stages
# shared by content (dflash/artifacts/sharing.py). The env, warmup and data rules run once
# per store key: results/.shared/<stage>-<key>/<stage>/, the key being the content their params
# carry (spec fields + code fingerprint + lock, or the env's key). `link_stage` then makes each
# spec's results/<spec>/<stage>/ a folder of hard links to it (a local job, well under a second),
# so train and bench read their inputs where they always did, and two specs with the same data
# fields (a γ sweep) run the data stage once.
from types import SimpleNamespace

from dflash.artifacts.sharing import SHARED_STAGES, lock_digest, spec_keys, store_root
from dflash.spec.sweeps import sweep_dir

CODE = {st: code_hash(st) for st in SHARED_STAGES}


def requested_specs():
    """The specs the command line asks for (bench_<spec>, data_<spec>, bench_<sweep>, a file under
    results/<spec>/ or results/<sweep>.sweep/; no target: the default spec), or None where a
    target names none (a store entry, a job sent to a cluster node): then any spec may be."""
    targets = command_line_targets()
    if targets is None:
        return None
    if not targets or targets == ["all"]:
        return {DEFAULT_SPEC}
    arms = {sw.name: set(sw.arm_names()) for sw in SWEEPS.values()}
    out = set()
    for t in targets:
        if t == "all":
            out.add(DEFAULT_SPEC)
            continue
        stage, _, name = t.partition("_")
        if not (stage in STAGE_TARGETS and (name in SPECS or name in arms)):  # a file?
            under = Path(t).is_relative_to(RESULTS) and Path(t).relative_to(RESULTS).parts
            name = under[0].removesuffix(".sweep") if len(under or ()) > 1 else None
        if name in arms:
            out |= arms[name]
        elif name in SPECS:
            out.add(name)
        else:
            return None
    return out


def _share_keys():
    """{(stage, spec): key} and {stage: {key: the spec whose file the shared job reads}}: the first
    requested spec with that key (any would do: they agree on every field the stage depends on),
    so the stage's log names a spec the user asked for, never another sweep's arm. The keys:
    dflash.artifacts.sharing.spec_keys, which the stage uses too, to name in its log and manifest
    the other specs that share its entry (dflash.spec.sharers: at run time, no param)."""
    keys, reps = {}, {st: {} for st in SHARED_STAGES}
    asked = requested_specs()
    for name in sorted(SPECS, key=lambda n: (asked is not None and n not in asked, n)):
        for st, k in spec_keys(SPECS[name], CODE, lock_digest(SPECS[name], workflow.basedir)).items():
            keys[(st, name)] = k
            reps[st].setdefault(k, name)
    return keys, reps


SHARE_KEY, SHARE_REP = _share_keys()


def shared_manifest(stage, key="{key}"):
    return f"{store_root(RESULTS, stage, key)}/{stage}/manifest.json"


def by_key(stage, fn):
    """A per-spec param or resource function, for the shared job: applied to its key's spec."""
    return lambda wc: fn(SimpleNamespace(spec=SHARE_REP[stage][wc.key]))


def shared_resources(stage):
    return {k: by_key(stage, v) if callable(v) else v for k, v in device_resources(stage).items()}


def shared_spec(stage):
    # A Path, not a str: Snakemake records no param it cannot represent, so which spec file the
    # job reads (it changes when a spec sorting first is added) never reruns it; the fields do.
    return by_key(stage, lambda wc: Path(spec_file(wc)))


def shared_env(stage):
    """The env store entry a warmup/data key was made in (its key is part of theirs)."""
    return lambda wc: shared_manifest("env", SHARE_KEY[("env", SHARE_REP[stage][wc.key])])


def _checksum(path):
    try:
        return json.loads(Path(path).read_text()).get("checksum", "none")
    except (OSError, ValueError):
        return "missing"


def shared_stage_cmd(stage):
    """stage_cmd with the store as the stage's folder (and the env it checks)."""
    env_at = "" if stage == "env" else " --env-at {params.env_at:q}"
    return stage_cmd(stage).replace(" 2>&1 |", f" --at {{params.at:q}}{env_at} 2>&1 |", 1)


def shared_params(stage):
    """The params of a shared rule: those of the per-spec rule it replaces, by key."""
    p = {"spec": shared_spec(stage), "python": by_key(stage, python_for),
         "fields": by_key(stage, spec_params(stage)), "code": CODE[stage],
         "at": lambda wc: str(store_root(RESULTS, stage, wc.key))}
    if stage == "env":
        p["lock_sha"] = by_key(stage, lock_sha)
    else:  # the env manifest it was made from, by checksum (see `upstream` in common.smk)
        p["env_at"] = lambda wc: str(Path(shared_env(stage)(wc)).parents[1])
        p["upstream"] = lambda wc: json.dumps({"env": _checksum(shared_env(stage)(wc))})
    return p



def link_cmd():
    """The link_stage job: results/<spec>/<stage>/ = hard links to the store entry, and the
    entry's log and Snakemake benchmark under the spec's names (dflash/artifacts/sharing.py main)."""
    return ("{params.python:q} -m dflash link {params.store:q} {wildcards.stage:q} "
            "{params.dest:q} --log {log:q} --also {params.src_log:q} {log:q} "
            "--also {params.src_bench:q} {params.dst_bench:q}")


def link_params():
    """Strings, stable per (spec, stage): only the checksum changes, when the entry is remade."""
    def entry(wc):
        return store_root(RESULTS, wc.stage, link_key(wc))

    return {
        "python": python_for,
        "key": link_key,
        # the store entry's manifest: remade there, it is relinked here (and what follows reruns)
        "checksum": lambda wc: _checksum(shared_manifest(wc.stage, link_key(wc))),
        "store": lambda wc: str(entry(wc)),
        "dest": lambda wc: str(Path(RESULTS, wc.spec)),
        "src_log": lambda wc: str(Path(LOGS, ".shared", f"{wc.stage}-{link_key(wc)}.log")),
        "src_bench": lambda wc: str(Path(BENCHMARKS, ".shared", f"{wc.stage}-{link_key(wc)}.tsv")),
        "dst_bench": lambda wc: str(Path(BENCHMARKS, wc.spec, f"{wc.stage}.tsv")),
    }


def link_key(wc):
    return SHARE_KEY[(wc.stage, wc.spec)]


def sweep_report_outputs(sweep):
    d = sweep_dir(RESULTS, sweep)
    return [f"{d}/report.json", f"{d}/report.md", f"{d}/sweep.png"]


def arm_files(leaf):
    return lambda wc: [f"{RESULTS}/{name}/{leaf}" for name in SWEEPS[wc.sweep].arm_names()]


def sweep_python(wc):
    return python_for(SimpleNamespace(spec=SWEEPS[wc.sweep].arm_names()[0]))


def sweep_arms(wc):
    """The arms and what they change: an edited sweep file rewrites the report."""
    return json.dumps([[a.name, a.overrides] for a in SWEEPS[wc.sweep].arms], sort_keys=True)


def sweep_report_cmd():
    results = shlex.quote(RESULTS).replace("{", "{{").replace("}", "}}")
    return (f"{{params.python:q}} -m dflash sweep-report {{params.sweep:q}} --results {results}"
            f" 2>&1 | tee {{log:q}}")
