# `make demo` and `make test` each create .venv on a fresh machine (about 2 minutes) first.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# One pytest worker per core (at most 4); the tests that share a module's fixtures stay on one
# worker (tests/conftest.py). PYTEST_XDIST= runs in one process.
PYTEST_XDIST ?= -n auto --maxprocesses=4 --dist loadgroup

.PHONY: demo test test-fast lint install clean

# The pinned requirements first, then the package itself (editable, its dependencies being
# those pins already).
$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements-test.txt
	$(VENV)/bin/pip install -q -e . --no-deps
	touch $(STAMP)

install: $(STAMP)

# Pretrain a small Delta Block model on the embedded corpus (CPU, a few minutes). Each demo
# starts fresh; `python -m delta_jax.train --config configs/demo.yaml` alone resumes.
demo: $(STAMP)
	rm -rf runs/demo
	$(VENV)/bin/python -m delta_jax.train --config configs/demo.yaml

# pytest exits 5 when it collected nothing: report that as the failure it is.
test: $(STAMP)
	$(VENV)/bin/python -m pytest tests $(PYTEST_XDIST) $(PYTEST_ARGS) || { rc=$$?; \
	  [ $$rc -ne 5 ] || echo "make test: pytest collected no tests" >&2; exit $$rc; }

# The suite without the tests marked slow.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest tests -m "not slow" $(PYTEST_XDIST) $(PYTEST_ARGS)

# ruff, configured in pyproject.toml (line length 100).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache runs
