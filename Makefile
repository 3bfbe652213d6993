# Targets are the README's commands. `make run` and `make test` install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-gpu lint format bench-attention bench-capture bench-e2e clean

$(STAMP): pyproject.toml scripts/install.sh
	EXTRAS=test VENV=$(VENV) ./scripts/install.sh
	touch $(STAMP)

install: $(STAMP)

## Start the service on the embedded default model (SmolLM2-135M-Instruct) on :8000.
run: $(STAMP)
	$(PY) -m service

## The CPU test suite (kernels under Triton's interpreter, model parity, engine, API, deploy).
test: $(STAMP)
	./scripts/test-tools.sh
	$(PY) -m pytest -q

## Tests that need CUDA (run on a GPU machine).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

lint: $(STAMP)
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .

bench-attention:
	python3 bench/attention.py
bench-capture:
	python3 bench/capture.py
bench-e2e:
	python3 bench/e2e.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
