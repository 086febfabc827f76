"""The data stage's generation for a spec, engine ``hf`` vs ``fast``, on the same samples in one
process, in the order hf, fast, fast, hf (so a drifting machine load cancels); wall and CPU
seconds of each (CPU seconds are the steadier figure on a shared box).

    PYTHONPATH=. python -m bench.data_engine_cpu specs/tiny.yaml --out bench/results/cpu/data_engine_tiny.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflash.decode.engine import Engine
from dflash.decode.generate import eos_ids_of, generate_batch, sample_seed
from dflash.spec.load import load_spec
from dflash.data.sources import build_samples, tokenizer_for
from dflash.eval.evalsets import eval_overlap
from dflash.data.chunks import make_chunks
from dflash.models.target import load_target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    spec = load_spec(a.spec)
    d = spec.data
    samples, *_ = build_samples(spec, tokenizer_for(spec.target.model), overlap=eval_overlap)
    chunks = make_chunks(samples, d.gen_batch_size)
    tgt = load_target(spec.target, a.device)
    eos, pad = eos_ids_of(tgt), tgt.tokenizer.pad_token_id
    order = [s for c in chunks for s in c]
    seeds = [sample_seed(spec.seed, s.sample_id) for s in order]
    max_len = max(len(s.prompt_ids) for s in order) + d.max_new_tokens

    def hf():
        out, i = [], 0
        for c in chunks:
            out += generate_batch(tgt.model, [s.prompt_ids for s in c], d.max_new_tokens,
                                    d.temperature, eos, pad, seeds[i:i + len(c)])
            i += len(c)
        return out

    def fast():
        eng = Engine(tgt.model, slots=d.gen_batch_size, max_len=max_len,
                     max_new_tokens=d.max_new_tokens, eos_ids=eos,
                     temperature=d.temperature)
        return eng.generate([s.prompt_ids for s in order], seeds)

    runs, answers = [], {}
    for name, fn in (("hf", hf), ("fast", fast), ("fast", fast), ("hf", hf)):
        t, c = time.time(), time.process_time()
        out = fn()
        wall, cpu = time.time() - t, time.process_time() - c
        n = sum(map(len, out))
        answers.setdefault(name, out)
        runs.append({"engine": name, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                     "new_tokens": n, "new_tokens_per_cpu_s": round(n / cpu, 2)})
        print(runs[-1], flush=True)
    mean = {k: {m: round(sum(r[m] for r in runs if r["engine"] == k) / 2, 1)
                for m in ("wall_s", "cpu_s")} for k in ("hf", "fast")}
    res = {"spec": a.spec, "samples": len(order), "max_new_tokens": d.max_new_tokens,
           "temperature": d.temperature, "gen_batch_size": d.gen_batch_size,
           "runs": runs, "mean": mean,
           "same_answers": answers["hf"] == answers["fast"] if d.temperature == 0 else None}
    print(json.dumps({"mean": mean, "same_answers": res["same_answers"]}))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
