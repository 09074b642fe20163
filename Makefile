# The two commands of the README: `make demo` (the main job) and `make test` (lint + the whole suite).
# Both create the development environment in .venv/ on first use and reuse it afterwards.
PY := .venv/bin/python
export OMP_WAIT_POLICY ?= PASSIVE
export MUJOCO_GL ?= egl

# Tests that start Ray servers run in a private network namespace (only loopback, everything on 127.0.0.1);
# as root `unshare -n`, else a user namespace (`unshare -rn`). Bounded: a wedged cluster cannot hang CI.
NETNS := $(if $(filter 0,$(shell id -u)),unshare -n,unshare -rn)

.PHONY: venv demo test test-ray lint bench
venv:
	@bash scripts/setup_venv.sh

demo: venv
	$(PY) -m simstream demo $(ARGS)

lint: venv
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks

# Two test processes (pytest-xdist), one module each at a time: the suite mostly waits on the processes it
# starts, and alone it kept one of two cores busy. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) $(ARGS)
	$(if $(ARGS),@echo "ARGS given: the Ray tests did not run (make test-ray runs them)",@$(MAKE) --no-print-directory test-ray)

test-ray: venv
	timeout 900 $(NETNS) sh -c 'ip link set lo up && exec $(PY) -m pytest -q tests/ray_backend'

bench: venv
	$(PY) benchmarks/sampling.py $(ARGS)
