# Two commands matter: `make up` (install + run the embedded stack) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install up test lint fmt

$(BIN)/kvgate: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(BIN)/kvgate

install: $(BIN)/kvgate

up: install
	$(BIN)/kvgate up $(ARGS)

test: install
	$(BIN)/python -m pytest -q -ra $(ARGS)

lint: install
	$(BIN)/ruff check services tests bench migrations
	$(BIN)/ruff format --check services tests bench migrations

fmt: install
	$(BIN)/ruff format services tests bench migrations
	$(BIN)/ruff check --fix services tests bench migrations
