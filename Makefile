# The dev loop. `make check` is what CI runs (after installing): lint, types, imports, the full suite.
# VENV: the virtualenv made by the README's install command.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: lint format types imports fast test check

lint:  ## ruff: lint rules and formatting
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:  ## apply ruff's formatting and safe fixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

types:  ## mypy over the package (settings in pyproject.toml)
	$(BIN)/mypy

imports:  ## the layering contracts (import-linter, settings in pyproject.toml)
	$(BIN)/lint-imports

fast:  ## the unit tests only: core, planner, config, index, layouts (under a minute)
	$(BIN)/python -m pytest -m unit -q

test:  ## the whole suite, as the README says
	$(BIN)/python -m pytest

check: lint types imports test
