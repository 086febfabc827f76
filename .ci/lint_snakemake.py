"""`snakemake --lint`, failing on every lint but the one the Snakefile explains: no conda or
container directive per rule (the env stage is the environment mechanism). Exit 0 clean."""
import re
import subprocess
import sys

ALLOWED = "Specify a conda environment or container for each rule."
out = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], capture_output=True,
                     text=True)
text = out.stdout + out.stderr
lints = re.findall(r"^\s+\* (.+?):?$", text, re.M)
bad = [x for x in lints if not x.startswith(ALLOWED.rstrip("."))]
if bad or not re.search(r"Lints for|Congratulations", text):
    print(text)
    print(f"snakemake --lint: {len(bad)} lint(s) beyond the allowed one: {bad}", file=sys.stderr)
    sys.exit(1)
print(f"snakemake --lint: clean ({len(lints)} rules without conda/container, on purpose)")
