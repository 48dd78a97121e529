# `make demo` and `make test` each create (or reuse) .venv, install dreamjax with what it needs, and run.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed
PIP := $(VENV)/bin/python -m pip --quiet --disable-pip-version-check

.PHONY: demo test bench

$(STAMP): pyproject.toml tools/install_system_deps.sh
	bash tools/install_system_deps.sh
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	# ALFWorld's planner runs a bare `python` in its build script, which pip's isolated build environment breaks.
	$(PIP) install --no-build-isolation fast-downward-textworld==20.6.4
	$(PIP) install -e '.[dev,envs,gcs]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dreamjax reproduce --config configs/demo.py

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/python experiments/bench/sampler.py
