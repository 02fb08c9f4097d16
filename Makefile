# `make demo` and `make test` each create .venv on a fresh machine first: demo the runtime
# stack alone (requirements.txt), test the test oracles and libtpu on top
# (requirements-test.txt) and the GPU compiler beside it (.gpu-compiler).
PYTHON ?= python3
VENV := .venv
RUNTIME_STAMP := $(VENV)/.runtime-stamp
TEST_STAMP := $(VENV)/.test-stamp
PYTEST_ARGS ?=
# One pytest worker per core (at most 4); the tests that share a module's fixtures stay on one
# worker (tests/conftest.py). PYTEST_XDIST= runs in one process.
PYTEST_XDIST ?= -n auto --maxprocesses=4 --dist loadgroup

.PHONY: demo test test-all lint install install-test gpu-compiler clean

# The pinned runtime requirements, then the package itself (editable, its dependencies being
# those pins already).
$(RUNTIME_STAMP): requirements.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q -e . --no-deps
	touch $(RUNTIME_STAMP)

# The test oracles (torch, transformers, lm_eval), pytest, ruff and libtpu.
$(TEST_STAMP): $(RUNTIME_STAMP) requirements-test.txt
	$(VENV)/bin/pip install -q -r requirements-test.txt
	touch $(TEST_STAMP)

install: $(RUNTIME_STAMP)

install-test: $(TEST_STAMP)

# The GPU compiler (jax's CUDA plugin, ptxas, cuDNN; about 1.7 GB) in a folder of its own, not
# the venv: only the planner puts it on its path, to compile for H100s and H200s on a host
# without a GPU (delta_jax/plan/gpus.py). The tests compile with it too.
GPU_COMPILER := .gpu-compiler
GPU_STAMP := $(GPU_COMPILER)/.installed-stamp
$(GPU_STAMP): requirements-gpu-compiler.txt $(RUNTIME_STAMP)
	rm -rf $(GPU_COMPILER)
	$(VENV)/bin/pip install -q --no-deps --target $(GPU_COMPILER) -r requirements-gpu-compiler.txt
	touch $(GPU_STAMP)

gpu-compiler: $(GPU_STAMP)

# Pretrain a small Delta Block model on the embedded corpus (CPU, a few minutes). Each demo
# starts fresh; `python -m delta_jax.train --config configs/demo.yaml` alone resumes.
demo: $(RUNTIME_STAMP)
	rm -rf runs/demo
	$(VENV)/bin/python -m delta_jax.train --config configs/demo.yaml

# `make test`: the quick suite, every module, the tests marked slow left out. `make test-all`:
# everything (CI). pytest exits 5 when it collected nothing: report that as the failure it is.
test: $(TEST_STAMP) $(GPU_STAMP)
	$(VENV)/bin/python -m pytest tests -m "not slow" $(PYTEST_XDIST) $(PYTEST_ARGS) || { rc=$$?; \
	  [ $$rc -ne 5 ] || echo "make test: pytest collected no tests" >&2; exit $$rc; }

test-all: $(TEST_STAMP) $(GPU_STAMP)
	$(VENV)/bin/python -m pytest tests $(PYTEST_XDIST) $(PYTEST_ARGS) || { rc=$$?; \
	  [ $$rc -ne 5 ] || echo "make test-all: pytest collected no tests" >&2; exit $$rc; }

# ruff, configured in pyproject.toml (line length 100).
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache runs
