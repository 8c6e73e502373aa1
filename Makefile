# The README's two commands: `make demo` and `make test`. Both set up what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-compiled lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,hf,data,yaml,lora,qlora,wandb]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/cephalo demo

test: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/python -m pytest -q --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# The equivalence suites with every engine's blocks compiled (docs/testing.md): not part of
# `make test` (each rank compiles its block types: ~20 min on 2 cores).
COMPILED_SUITES := tests/test_equivalence.py tests/test_plan_invariance.py tests/test_engine_dist.py
test-compiled: $(STAMP)
	CEPHALO_TEST_COMPILE=inductor $(BIN)/python -m pytest -q --timeout=3000 $(COMPILED_SUITES)

lint: $(STAMP)
	$(BIN)/ruff check src tests bench scripts
	$(BIN)/ruff format --check src tests bench scripts

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) runs .pytest_cache
