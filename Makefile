# qkov: set up, build the book, run the tests. See README.md.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= python3
VENV ?= .venv
PROFILE ?= cpu
# DRY_RUN=1: every chapter with the profile's models, data and grids, each run capped at a few steps
DRY_RUN ?=
DRY := $(if $(DRY_RUN),QKOV_DRY_RUN=$(DRY_RUN))
DATA ?= $(abspath ../shared/data)
# chapters executed at once by `make book` (a chapter that trains in several processes runs alone)
JOBS ?= 2
BIN := $(VENV)/bin
export QKOV_DATA_DIR ?= $(DATA)

.PHONY: setup book book-cached estimate test browser-test clean lab data data-check

# uv installs what pip would, several times faster; it reads no pip configuration, so it is handed pip's
# find-links (where a machine keeps local wheels: on the project machines, torch's CPU build)
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(BIN)/uv pip install --quiet --python $(BIN)/python $(foreach l,$(FIND_LINKS),--find-links $(l))
# Every process started here writes the bytecode of the modules it imports into .venv, once. Some machines
# set PYTHONDONTWRITEBYTECODE, and then every chapter's kernel compiled its imports again; compiling all of
# .venv at set-up instead took longer than the book's imports (about 5,000 of its 22,000 modules)
unexport PYTHONDONTWRITEBYTECODE

$(BIN)/activate: requirements.txt requirements-nodeps.txt requirements-setup.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements-setup.txt
	$(UV_INSTALL) -r requirements.txt
	$(UV_INSTALL) --no-deps -r requirements-nodeps.txt
	$(UV_INSTALL) --no-deps -e .
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $(BIN)/activate

setup: $(BIN)/activate  ## create .venv and install everything

data-check:  ## before set-up, with the system python: stop at once if data is missing and cannot be downloaded
	$(PYTHON) qkov_lib/data/sources.py check --probe

data: setup  ## download the official releases into $(QKOV_DATA_DIR), verify their sha256, build the data folder
	$(BIN)/python -m qkov_lib.data.fetch fetch --dest "$(QKOV_DATA_DIR)"

book: data-check setup  ## execute every chapter, $(JOBS) at once (profile $(PROFILE); DRY_RUN=1: steps capped), build _build/html
	$(BIN)/python -m qkov_lib.data.fetch check --fetch
	rm -rf _build/results
	QKOV_PROFILE=$(PROFILE) $(DRY) $(BIN)/qkov book --mode run --jobs $(JOBS)

estimate: setup  ## each chapter's work and estimated time on this machine's device (profile $(PROFILE)), nothing trained
	QKOV_PROFILE=$(PROFILE) $(BIN)/python -m qkov_lib.cost

test: setup  ## the unit tests
	$(BIN)/python -m pytest -q --ignore=tests/browser

book-cached: data-check setup  ## like book, but reuse outputs keyed on the chapter cells AND qkov_lib
	$(BIN)/python -m qkov_lib.data.fetch check --fetch
	QKOV_PROFILE=$(PROFILE) $(DRY) $(BIN)/qkov book --mode cache

browser-test:  ## headless Chromium checks of the built _build/html (needs chromium + chromium-driver)
	QKOV_BROWSER_REQUIRED=1 $(BIN)/python -m pytest -q -rs tests/browser

LAB_SETTINGS := $(VENV)/etc/jupyter/labconfig/default_setting_overrides.json
lab: setup  ## JupyterLab from .venv: book/*.md open as notebooks (jupytext), default profile
	@# Lab opens .md as text unless told otherwise: make jupytext's notebook view the default
	@# for Markdown/MyST, in this environment only (not in ~/.jupyter)
	$(BIN)/jupytext-config --settings-file $(LAB_SETTINGS) set-default-viewer markdown myst
	$(BIN)/jupyter lab --ServerApp.root_dir=. $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

clean:
	rm -rf _build runs
