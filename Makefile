# Everything installs into .venv; nothing relies on packages installed by hand.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DEMO_WS := demo-workspace
DEMO_Q  := In which village was the founder of the society that awards the Greyling Medal born?

.PHONY: install demo test lint bench bench-scale clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.installed tests/llm_support/install_llm_server.sh \
		tests/browser_support/install_chromium.sh tests/system_support/install_tools.sh
	$(BIN)/pip install -q -e '.[test]'
	bash tests/llm_support/install_llm_server.sh $(BIN)/python $(VENV)/models
	bash tests/browser_support/install_chromium.sh
	bash tests/system_support/install_tools.sh
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/noderag index $(DEMO_WS) --input sample_corpus
	$(BIN)/noderag stats $(DEMO_WS)
	$(BIN)/noderag query $(DEMO_WS) "$(DEMO_Q)" --show-context --budget 1000

lint: $(VENV)/.test-installed
	$(BIN)/ruff check noderag_cli tests bench devtools

test: $(VENV)/.test-installed lint
	$(BIN)/python -m pytest -q -ra -n auto --dist loadfile

bench: $(VENV)/.test-installed
	$(BIN)/python -m bench.bench --out docs/benchmarks.md

# indexing and search from 2,000 to 100,000 passages, and an update of 1% at 100,000 against a
# fresh build, three times in turn (about an hour in all): docs/benchmarks-scale.md, which the next
# `make bench` includes in docs/benchmarks.md
bench-scale: $(VENV)/.test-installed
	$(BIN)/python -m bench.bench_scale --out docs/benchmarks-scale.md
	$(BIN)/python -m bench.bench_update_scale >> docs/benchmarks-scale.md

clean:
	rm -rf $(VENV) $(DEMO_WS) bench-out
