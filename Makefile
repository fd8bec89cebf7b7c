# The two commands a fresh machine needs (see README.md).  Both set up .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
export PJRT_DEVICE ?= CPU
# Test worker processes (pytest-xdist; each runs whole files, so module fixtures run once).
TEST_WORKERS ?= 2

.PHONY: demo test test-quick lint bench

## Run the main job: train, record, compare, assess and report (default sqlite store).
demo:
	@scripts/bootstrap.sh
	@$(PY) -m pipelines.demo $(ARGS)

# Every test phase's worker and times (benchmarks/bench_suite.py reads it: the slowest
# tests, each worker's wall time; --write refreshes tests/durations.json, the file order).
TIMINGS ?= test-artifacts/timings.json

## Run the whole test suite (what CI runs).
test:
	@scripts/bootstrap.sh --with-test-deps
	@$(PY) -m ruff check src tests pipelines benchmarks
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 --timings $(TIMINGS) $(ARGS)

## Everything but the end-to-end pipelines (marker e2e): the inner loop, a few minutes.
test-quick:
	@scripts/bootstrap.sh --with-test-deps
	@$(PY) -m ruff check src tests pipelines benchmarks
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not e2e" --durations=30 --timings $(TIMINGS) $(ARGS)

lint:
	@$(PY) -m ruff check src tests pipelines benchmarks

bench:
	@scripts/bootstrap.sh
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b; done
