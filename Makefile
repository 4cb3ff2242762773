# The two set-up commands: `make demo` and `make test`. Each creates .venv and installs on first use.
PYTHON ?= python3
# The CPU build of torch; on a GPU machine set TORCH_SPEC to the build you need (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NUM_PROCS ?= 2

.PHONY: install demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/shardwise --num_gpus $(NUM_PROCS) examples/demo/train.py

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) checkpoints runs .pytest_cache
