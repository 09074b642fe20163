# The two commands of the README: `make demo` (the main job) and `make test` (lint + the whole suite).
# Both create the development environment in .venv/ on first use and reuse it afterwards.
PY := .venv/bin/python
export OMP_WAIT_POLICY ?= PASSIVE
export MUJOCO_GL ?= egl

.PHONY: venv demo test lint bench
venv:
	@bash scripts/setup_venv.sh

demo: venv
	$(PY) -m simstream demo $(ARGS)

lint: venv
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

test: lint
	$(PY) -m pytest -q $(ARGS)

bench: venv
	$(PY) benchmarks/sampling.py $(ARGS)
