# stencild — set-up, serve, test, bench.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
TORCH  := torch==2.13.0
# cpu or cuda: the torch build `make setup` installs. cuda where the NVIDIA
# driver sees a GPU; `make setup DEVICE=cuda` (after `make clean`) forces it.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
ifeq ($(DEVICE),cuda)
# PyPI's Linux wheels of torch are its CUDA builds (CUDA libraries and Triton
# inside); asked of PyPI alone, with pip's own configuration off, so a local
# CPU-only wheel directory or index (find-links, extra-index-url) cannot
# shadow them (2.13.0+cpu would satisfy the pin and sort above it).
TORCH_INSTALL := $(TORCH) --index-url https://pypi.org/simple
TORCH_ENV := PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL=
else
# The CPU build, from PyTorch's own index (2.13.0+cpu sorts above PyPI's
# 2.13.0, which is the CUDA build: gigabytes of CUDA libraries); torch alone
# there, its dependencies from PyPI in the next step.
TORCH_INSTALL := --no-deps $(TORCH) --extra-index-url https://download.pytorch.org/whl/cpu
TORCH_ENV :=
endif

.PHONY: setup serve test bench bench-serve lint protos clean

setup: $(VENV)/.installed

# torch goes in first and pinned: an unpinned torch would pull a CUDA build
# onto a CPU machine.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@echo "installing $(TORCH) for $(DEVICE)"
	$(TORCH_ENV) $(PIP) install -q $(TORCH_INSTALL)
	$(PIP) install -q $(TORCH)
	@$(PY) -W ignore::UserWarning -c "import sys, torch; sys.exit('$(DEVICE)' == 'cuda' and not torch.version.cuda and 'installed a torch without CUDA')"
	$(PIP) install -q -e '.[dev]'
	@# buf lints and compiles the protos for other languages (tests/service/test_protos.py);
	@# from npm, optional: without it that test is skipped.
	-npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0 >/dev/null 2>&1 \
		|| echo "npm could not install buf: the proto lint test will be skipped"
	@# A Node.js gRPC client drives the server from another language (tests/e2e/test_node_client.py).
	-npm install --silent --no-audit --no-fund --prefix .tools @grpc/grpc-js@1.14.7 @grpc/proto-loader@0.8.1 \
		>/dev/null 2>&1 || echo "npm could not install @grpc/grpc-js: the Node client test will be skipped"
	touch $@

serve: setup
	$(VENV)/bin/stencild serve

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) bench/throughput.py

# Python stubs for every proto under protos/ into service/gen/ (a test keeps them in sync).
protos: setup
	$(PY) -m service.protogen

# gRPC serving vs the offline engine, concurrency 1/4/16 on the bench preset.
bench-serve: setup
	$(PY) bench/serve.py

lint: setup
	$(VENV)/bin/ruff check engine grammar service tests bench
	$(VENV)/bin/mypy engine grammar service bench tests

clean:
	rm -rf $(VENV) .tools build *.egg-info .pytest_cache .mypy_cache .ruff_cache
