# qkov: set up, build the book, run the tests. See README.md.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PROFILE ?= cpu
DATA ?= $(abspath ../shared/data)
BIN := $(VENV)/bin
export QKOV_DATA_DIR ?= $(DATA)

.PHONY: setup book book-cached test browser-test clean

$(BIN)/activate: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(BIN)/activate

setup: $(BIN)/activate  ## create .venv and install everything

book: setup  ## execute every chapter (profile $(PROFILE)) and build _build/html
	rm -rf _build/results
	QKOV_PROFILE=$(PROFILE) $(BIN)/jupyter-book build . -W --keep-going --all

test: setup  ## the unit tests
	$(BIN)/python -m pytest -q --ignore=tests/browser

book-cached: setup  ## like book, but reuse outputs keyed on the chapter cells AND qkov_lib
	QKOV_PROFILE=$(PROFILE) $(BIN)/qkov book --mode cache

browser-test:  ## headless Chromium checks of the built _build/html (needs chromium + chromium-driver)
	QKOV_BROWSER_REQUIRED=1 $(BIN)/python -m pytest -q -rs tests/browser

clean:
	rm -rf _build runs
