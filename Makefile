# Two entry points (see README): `make run` and `make test`. Both set up .venv from the
# hash-pinned lock first (once; redone when a lock changes).
VENV ?= .venv
PY := $(VENV)/bin/python
LOCK := envs/cpu-py311.lock
NODEPS := envs/cpu-py311-nodeps.lock

.PHONY: setup run test
setup: $(VENV)/.installed

$(VENV)/.installed: $(LOCK) $(NODEPS) pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps --require-hashes -r $(NODEPS)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

run: setup
	$(VENV)/bin/snakemake --cores all

# --durations=20: pytest's slowest 20 printed after every run, so a test that grows shows
test: setup
	$(PY) -m pytest -q --durations=20
