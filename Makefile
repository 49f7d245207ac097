# pdserve: the two commands a user needs are `make up` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
BASELINE := protos/baseline/pdserve-v1.binpb
INSTALL_STAMP := $(VENV)/.installed
NODE_CLIENT := clients/node
# NOTE: apt-get needs root; elsewhere it goes through sudo.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: help venv install model up proto proto-check lint format typecheck test scope-seconds test-fast test-transports demo-model \
	contract-baseline lock clean node-deps system-deps image gpu-kit chaos llama-convert

help:  ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s $$'\t'

$(INSTALL_STAMP): constraints.txt shared/pyproject.toml shared/setup.py shared/csrc/*.cpp shared/csrc/*.h services/*/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade -c constraints.txt pip setuptools wheel
	# NOTE: torch is pinned explicitly so pip never resolves an unpinned (CUDA) build.
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e 'shared[engine,dev,nixl]' \
		-e services/gateway -e services/prefill -e services/decode
	touch $@

venv: $(INSTALL_STAMP)  ## create .venv and install all four distributions with dev extras

install: venv

proto: venv  ## regenerate the pdserve.v1 Python code (shared/src/pdserve/v1) from protos/
	$(PY) tools/protogen.py

proto-check: venv  ## fail if the committed generated code is stale
	$(PY) tools/protogen.py --check

lint: venv  ## ruff, ruff format, buf lint/format/breaking, generated-code freshness
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	$(BIN)/buf breaking --against $(BASELINE)
	$(MAKE) --no-print-directory proto-check

model: venv  ## fetch the default model (pinned wheel from PyPI) and prepare it once into the cache
	$(BIN)/pdserve pull

up: venv model  ## install, then run gateway + prefill + decode on SmolLM2-135M-Instruct (UP_ARGS="--decodes 2")
	$(BIN)/pdserve up $(UP_ARGS)

demo-model: venv  ## generate the built-in demo model into the cache (prints its path)
	$(PY) -m pdserve.engine.demo

typecheck: venv  ## mypy on all four packages (shared, gateway, prefill, decode)
	$(BIN)/mypy

format: venv  ## apply ruff and buf formatting
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	$(BIN)/buf format -w

contract-baseline: venv  ## refresh the buf breaking baseline: only together with a protocol version bump
	$(BIN)/buf build -o $(BASELINE)
	@echo "baseline refreshed: commit it together with the PROTOCOL_VERSION bump and name both in the message"

node-deps: $(NODE_CLIENT)/node_modules/.package-lock.json  ## npm ci for the Node.js client test (skipped without npm)

# NOTE: npm rewrites node_modules/.package-lock.json on every install, so it is the stamp.
$(NODE_CLIENT)/node_modules/.package-lock.json: $(NODE_CLIENT)/package.json $(NODE_CLIENT)/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd $(NODE_CLIENT) && npm ci --ignore-scripts --no-audit --no-fund; \
	else echo "npm not found: tests/e2e/test_node_client.py will be skipped"; fi

system-deps:  ## install the system packages the tests run (redis-server: KV store; etcd: shared registry; iproute2, iptables: test hosts; podman, runc, debootstrap: the image; g++: the int4 kernel)
	@command -v g++ >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends g++ python3-dev)
	@command -v redis-server >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends redis-server)
	@command -v etcd >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends etcd-server)
	@command -v ip >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends iproute2)
	@command -v iptables >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends iptables)
	@(command -v podman && command -v runc && command -v debootstrap) >/dev/null 2>&1 || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends podman runc debootstrap)
	@$(SUDO) deploy/podman-setup.sh

# NOTE: llama.cpp's converter (convert_hf_to_gguf.py, which writes the GGUF files people
# download) from the llama.cpp sources that PyPI's llama-cpp-python sdist vendors; the GGUF tests
# convert tiny checkpoints with it (tests/unit/engine/test_gguf_llama_convert.py).
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CONVERT := $(VENV)/llama.cpp/convert_hf_to_gguf.py
$(LLAMA_CONVERT): | $(INSTALL_STAMP)
	rm -rf $(VENV)/llama.cpp $(VENV)/llama-cpp-sdist
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(VENV)/llama-cpp-sdist \
		llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(VENV)/llama-cpp-sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(VENV)/llama-cpp-sdist \
		$(foreach part,convert_hf_to_gguf.py conversion gguf-py,llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/$(part))
	mv $(VENV)/llama-cpp-sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp $(VENV)/llama.cpp
	rm -rf $(VENV)/llama-cpp-sdist

llama-convert: $(LLAMA_CONVERT)  ## fetch llama.cpp's convert_hf_to_gguf.py (the llama-cpp-python sdist's) into .venv/llama.cpp

# NOTE: three workers (pytest-xdist) on the 2-core machine: the end-to-end tests wait on
# processes and events, and two left about a sixth of both cores idle. A module's (or class's)
# tests stay on one worker, so the clusters they share start once; the scope that took longest
# last run goes first (tests/support/scheduling.py). PYTEST_WORKERS=0 runs in this process.
# The suite writes bytecode caches (__pycache__, ignored by git) even where the environment
# sets PYTHONDONTWRITEBYTECODE: each worker's collection then reads the test modules rewritten
# once instead of rewriting them all (about 17 s of CPU against 11 s), and each process that
# imports pdserve without the fork server skips compiling it.
PYTEST_WORKERS ?= 3
test: system-deps venv model llama-convert lint typecheck node-deps image  ## lint, type-check, then the whole pytest suite (PYTEST_WORKERS=3)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadscope

# NOTE: the scopes' seconds a clean clone schedules by (tests/support/scope_seconds.json), from
# this checkout's last `make test`.
scope-seconds: venv  ## refresh tests/support/scope_seconds.json from the last make test's timings
	PYTHONPATH=tests $(PY) -c 'from support import scheduling; scheduling.commit_seconds()'

test-fast: system-deps venv llama-convert  ## pytest without lint
	$(BIN)/pytest -x -q

# NOTE: the whole fault matrix (make test runs its fast cells); the results file is written
# anew, then printed as the table docs/fault-matrix.md shows.
FAULT_MATRIX_RESULTS := .pytest_cache/d/fault-matrix/results.jsonl
chaos: system-deps venv  ## every fault-matrix cell (fault x target x phase), then the table (docs/fault-matrix.md)
	rm -f $(FAULT_MATRIX_RESULTS)
	PDSERVE_FAULT_MATRIX=$(FAULT_MATRIX_RESULTS) $(BIN)/pytest -q -n 0 --chaos tests/e2e/test_fault_matrix.py; \
		status=$$?; $(PY) tools/fault_matrix.py $(FAULT_MATRIX_RESULTS); exit $$status

# NOTE: `make test` runs the clusters on the default transport (shared memory: one host; the
# nixl transport has its own tests and is forced here).
TRANSPORT_SUITES = tests/e2e/test_chaos.py tests/e2e/test_gateway_real_services.py tests/integration/prefill
test-transports: system-deps venv model  ## the e2e, chaos and prefill suites once per forced KV transport (nixl, tcp, grpc; cuda_ipc on its CPU stand-in: e2e and chaos)
	for transport in nixl tcp grpc; do \
		PDSERVE_TEST_KV_TRANSPORT=$$transport $(BIN)/pytest -q $(TRANSPORT_SUITES) || exit 1; \
	done
	PDSERVE_TEST_KV_TRANSPORT=cuda_ipc PDSERVE_KV_IPC_STANDIN=1 \
		$(BIN)/pytest -q tests/e2e/test_chaos.py tests/e2e/test_gateway_real_services.py

gpu-kit: venv model  ## the GPU kit in .gpukit/ (py3.12 wheels, the model; GPU_KIT_FLASH=1 adds flash-attn 4, GPU_KIT_NIXL=0 leaves NIXL out): see docs/gpu.md
	$(PY) tools/gpu_kit.py $(if $(GPU_KIT_FLASH),--flash) $(if $(filter 0,$(GPU_KIT_NIXL)),--no-nixl)

# NOTE: deploy/image.py: the runtime at hand (podman or docker), the base (BASE_IMAGE, else
# python:3.11-slim-bookworm, else a Debian base made with debootstrap where no registry
# answers), the wheels and the model fetched here into .image/ (the build needs no network);
# nothing is built when the image with the same content hash exists. See docs/deploy.md.
IMAGE ?= pdserve:0.1.0
BASE_IMAGE ?=
image: venv  ## build the service image (deploy/Dockerfile) unless up to date; prints its size: IMAGE=pdserve:0.1.0 BASE_IMAGE=...
	IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) $(PY) deploy/image.py

lock:  ## re-pin constraints.txt from the current venv (review the diff)
	{ head -2 constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -vE '^(pdserve|pip|setuptools|wheel)' \
		| sed 's/^torch==\(.*\)+cpu/torch==\1/'; } > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache $(NODE_CLIENT)/node_modules
