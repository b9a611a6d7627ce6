# Two commands matter: `make up` (install + run the embedded stack) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install browser up test lint fmt

$(BIN)/kvgate: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/kvgate

install: $(BIN)/kvgate

up: install
	$(BIN)/kvgate up $(ARGS)

# the operator page's end-to-end test drives Debian's chromium with Playwright (a dev extra)
browser:
	command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium; }

test: install browser
	$(BIN)/python -m pytest -q -ra $(ARGS)

lint: install
	$(BIN)/ruff check services tests bench migrations
	$(BIN)/ruff format --check services tests bench migrations

fmt: install
	$(BIN)/ruff format services tests bench migrations
	$(BIN)/ruff check --fix services tests bench migrations
