# The two set-up commands: `make demo` and `make test`. Each creates .venv and installs on first use.
PYTHON ?= python3
# The CPU build of torch; on a GPU machine set TORCH_SPEC to the build you need (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NUM_PROCS ?= 2

.PHONY: install demo test test-fast clean finetune-demo

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

# LoRA fine-tuning of a tiny LLaMA under ZeRO-3 (examples/finetune_llm/README.md): a briefly pretrained base,
# then the adapter on the bundled prompt/response pairs, then greedy completions from the merged weights.
FT := checkpoints/finetune_llm
finetune-demo: $(STAMP)
	test -f $(FT)/base/model.safetensors || $(BIN)/python examples/finetune_llm/make_assets.py --skip_bundled --base $(FT)/base
	$(BIN)/shardwise --num_gpus $(NUM_PROCS) examples/finetune_llm/train.py --model $(FT)/base --output_dir $(FT)/out --merge
	$(BIN)/python examples/finetune_llm/generate.py --model $(FT)/out/merged
