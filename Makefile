# The two set-up commands: `make demo` and `make test`. Each creates .venv and installs on first use.
PYTHON ?= python3
# torch: the CPU build by default. Pip first looks where it is configured to (its find-links and indexes: a local
# CPU wheel, as on CI, is used as it is; PyPI has no "+cpu" builds, so elsewhere this fails within a second), then
# in PyTorch's CPU index. For a CUDA build name both, e.g.
#   make install TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu130
# (PyPI's Linux torch is a CUDA build too: TORCH_INDEX=https://pypi.org/simple). With another index than the CPU
# one, pip goes there directly, so a local CPU wheel never stands in for the build asked for.
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(TORCH_CPU_INDEX)
# Bytecode is written as modules are first imported, not at install: byte-compiling all ~15,000 files of a venv
# (transformers' 2,900 of which the tests import a few hundred) took ~50 CPU-s per venv, the imports of a whole
# `make test` compile ~15. So installers do not compile (pip --no-compile; uv's default), and the recipes here
# write what they import even where PYTHONDONTWRITEBYTECODE is set (as on CI), where every interpreter would
# otherwise compile torch anew. `make install` imports what every shardwise process does (WARM_IMPORTS) once, so
# that scripts run outside make find those compiled too.
unexport PYTHONDONTWRITEBYTECODE
PIP_FLAGS := -q --disable-pip-version-check --no-compile
# uv (from PyPI, put in each venv first) installs torch and the ~100 packages beyond it: with the test and docs
# extras ~6 s where pip takes ~130 s on a clean machine (CI installs both venvs from nothing on every run). uv reads
# neither pip's configuration nor its constraints: for torch's local CPU wheel it is given pip's find-links. Where
# uv cannot be installed or fails, pip does the same work as before. UV_SPEC= (empty): pip alone.
UV_SPEC ?= uv==0.13.9
# $(call install_uv,<venv>)
install_uv = $(if $(UV_SPEC),$(1)/bin/pip install $(PIP_FLAGS) "$(UV_SPEC)" > /dev/null 2>&1 \
	|| echo "$(UV_SPEC) could not be installed; pip installs instead",true)
# $(call uv_or,<venv>,<install arguments>): "uv installs them, or ", empty where UV_SPEC is; pip's command follows.
# A uv that is there but fails says so (its own errors may be hidden, as torch's are), so a slow pip is explained.
uv_or = $(if $(UV_SPEC),{ [ -x $(1)/bin/uv ] && { $(1)/bin/uv pip install -q --python $(1)/bin/python $(2) \
	|| { echo "uv could not install them; pip installs instead" >&2; false; }; }; } || )
pip_find_links = $$($(1)/bin/pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$$/--find-links \1/p" | sort -u)
# $(call bulk_install,<venv>,<pip install arguments>)
bulk_install = $(call uv_or,$(1),$(2))$(1)/bin/pip install $(PIP_FLAGS) $(2)
# $(call install_torch,<venv>)
torch_from_index = $(1)/bin/pip install $(PIP_FLAGS) --index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)"
install_torch = $(if $(filter $(TORCH_CPU_INDEX),$(TORCH_INDEX)),$(call uv_or,$(1),$(pip_find_links) "$(TORCH_SPEC)" 2>/dev/null)\
	$(1)/bin/pip install $(PIP_FLAGS) "$(TORCH_SPEC)" 2>/dev/null \
	|| { echo "$(TORCH_SPEC): not where pip looks by default; installing it from $(TORCH_INDEX)"; $(call torch_from_index,$(1)); },$(call torch_from_index,$(1)))
VENV := .venv
SHARDWISE_EDITABLE := -e ".[test,docs]"
# torch's optimizers import torch._dynamo at their first step
WARM_IMPORTS := torch._dynamo, torch.distributed, transformers, shardwise, deepspeed
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NUM_PROCS ?= 2
# The real DeepSpeed, in a venv of its own, as the reference the parity tests compare against.
DS_VENV := .dsvenv
DS_STAMP := $(DS_VENV)/.installed
DS_BASE := $(DS_VENV)/.base
DEEPSPEED_SPEC ?= deepspeed==0.19.8

.PHONY: install deepspeed-compat demo test test-deepspeed gpu-install test-gpu clean finetune-demo docs ds-ops

# shardwise, its test extras, and the `deepspeed` compatibility package (compat/deepspeed), so that
# Hugging Face Trainer/accelerate and DeepSpeed scripts run on shardwise in this venv.
$(STAMP): pyproject.toml compat/deepspeed/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call install_uv,$(VENV))
	$(call install_torch,$(VENV))
	$(call bulk_install,$(VENV),$(SHARDWISE_EDITABLE))
	$(BIN)/pip install $(PIP_FLAGS) --no-deps -e ./compat/deepspeed
	$(BIN)/python -c "import $(WARM_IMPORTS)"
	touch $@

install: $(STAMP)

# The docs site (mkdocs.yml) into site/, strict: a broken link or an API name that no longer resolves fails it.
# The generated pages (benchmarks, troubleshooting) are rendered first; tests/unit/test_docs_pages.py fails when
# the committed ones differ (CI: DOCS_PAGES=--check, so that a stale committed page fails rather than being
# rewritten before the test sees it). `make install` puts the `docs` extra in .venv: `make test` opens the site.
DOCS_PAGES ?= --write
docs: $(STAMP)
	$(BIN)/python tools/docs_pages.py $(DOCS_PAGES)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q -d site

# docs/moving-from-deepspeed.md ("Hugging Face Trainer, accelerate and DeepSpeed's own scripts"): the `deepspeed`
# package and command in .venv, mapped onto shardwise.
deepspeed-compat: $(STAMP)
	@$(BIN)/python -c "import deepspeed; print('deepspeed', deepspeed.__version__, 'from', deepspeed.__file__)"

demo: $(STAMP)
	$(BIN)/shardwise --num_gpus $(NUM_PROCS) examples/demo/train.py

# Two pytest-xdist workers: the tests spend much of their time starting processes and waiting on them, so two
# workers keep both cores busy (conftest.py keeps each module on one worker). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder)

# The 30 slowest test phases close the output, so every CI log says where its minutes went.
test: $(STAMP)
	$(BIN)/python -m pytest -q -rs $(XDIST) --durations=30

# The same transformers/peft/accelerate/trl as .venv, with the real DeepSpeed instead of the compat package. In two
# parts: torch and DeepSpeed need nothing from .venv (.ci/run builds them while `make install` runs), the Hugging
# Face packages take .venv's versions.
$(DS_BASE):
	$(PYTHON) -m venv $(DS_VENV)
	$(call install_uv,$(DS_VENV))
	$(call install_torch,$(DS_VENV))
	$(DS_VENV)/bin/pip install $(PIP_FLAGS) "$(DEEPSPEED_SPEC)" pydantic safetensors rich \
		pytest pytest-timeout pytest-xdist
	touch $@

$(DS_STAMP): $(DS_BASE) $(STAMP)
	$(call bulk_install,$(DS_VENV),$$($(BIN)/pip freeze | grep -iE '^(transformers|peft|accelerate|numpy|trl|datasets)=='))
	touch $@

# DeepSpeed's CPU ops that the parity tests load, compiled ahead (torch's extension cache, ~/.cache/torch_extensions,
# keeps them; the tests would otherwise compile them on first use). .ci/run builds them on the core that
# `make install` leaves idle. The same compiler wrapper and accelerator as test-deepspeed, so the tests reuse them.
DS_OPS = CPUAdamBuilder FusedAdamBuilder ShareMemCommBuilder
ds-ops: $(DS_BASE)
	DS_ACCELERATOR=cpu CXX=$(CURDIR)/tools/cxx_without_debug_info $(DS_VENV)/bin/python -c "import deepspeed.ops.op_builder.cpu as ops; \
		[getattr(ops, name)().load() for name in '$(DS_OPS)'.split()]"

# Parity with the real DeepSpeed: its own modules in .dsvenv (they must run there, not skip), and the
# Trainer-level comparisons from .venv, which run each script under both.
test-deepspeed: $(STAMP) $(DS_STAMP)
	@# DeepSpeed builds its CPU ops on first use under torch's file lock; a build killed mid-way (Ctrl-C, a
	@# timeout) leaves the lock behind and every later load waits on it forever. No build takes 10 minutes.
	@find "$${TORCH_EXTENSIONS_DIR:-$$HOME/.cache/torch_extensions}" -name lock -mmin +10 -print -delete 2>/dev/null || true
	@# DeepSpeed's CPU all-reduce never unlinks its /dev/shm buffers (66 MB per rank and run): whatever the
	@# outcome, the ones no process uses any more go (tools/deepspeed_shm_leftovers.py).
	status=0; \
	DS_ACCELERATOR=cpu SHARDWISE_REQUIRE_DEEPSPEED=1 PYTHONPATH=src:. CXX=$(CURDIR)/tools/cxx_without_debug_info \
		$(DS_VENV)/bin/python -m pytest -q -rs $(XDIST) \
		tests/distributed/test_deepspeed_parity.py tests/distributed/test_deepspeed_parity_backward.py \
		tests/distributed/test_deepspeed_parity_bf16_masters.py tests/distributed/test_deepspeed_checkpoint_migration.py \
		tests/distributed/test_deepspeed_checkpoint_export.py tests/distributed/test_deepspeed_checkpoint_pipeline.py \
		tests/unit/test_deepspeed_parity_optim.py tests/unit/test_deepspeed_parity_curriculum.py \
		tests/unit/test_deepspeed_parity_sequence_tiling.py \
		tests/unit/test_config_keys.py::test_catalogue_matches_the_installed_deepspeed || status=$$?; \
	[ $$status -ne 0 ] || SHARDWISE_DEEPSPEED_PYTHON=$(DS_VENV)/bin/python CXX=$(CURDIR)/tools/cxx_without_debug_info \
		$(BIN)/python -m pytest -q -rs $(XDIST) -m deepspeed_parity tests/compat || status=$$?; \
	$(BIN)/python tools/deepspeed_shm_leftovers.py; \
	exit $$status

# The device suite, on a lent GPU machine (docs/contributing.md, "The device suite"): installs shardwise and the compat package
# for real into the image's Python beside its torch 2.11 (no network there: pydantic comes from .whl/, which
# tools/fetch_device_wheels.sh fills here and the device call carries), prints the machine, the versions and the
# commit, then runs tests/gpu on CUDA. The JUnit XML and a JSON summary (machine, versions, commit, each test) go
# to $$OUT, where the device tool collects them (runs/test-gpu/ where OUT is unset). Past GPU_TIMEOUT seconds pytest
# is interrupted (SIGINT), so the XML still holds what ran; the whole target stays under 5 minutes on an H100.
# A dry run here: make test-gpu GPU_PYTHON=.venv/bin/python GPU_INSTALL=0 (the CUDA-only tests skip).
GPU_PYTHON ?= python3
GPU_INSTALL ?= 1
GPU_OUT ?= $(if $(OUT),$(OUT),runs/test-gpu)
GPU_TIMEOUT ?= 270
gpu-install:
	@test -n "$$(ls .whl/*.whl 2>/dev/null)" || { echo "gpu-install: .whl/ is empty: run \
		tools/fetch_device_wheels.sh here and name .whl in the device call's carry" >&2; exit 2; }
	$(GPU_PYTHON) -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index \
		--find-links .whl --no-build-isolation . ./compat/deepspeed
	@# What Hugging Face transformers and accelerate will see: the compat package under the name `deepspeed`.
	$(GPU_PYTHON) -c "import deepspeed, shardwise; from transformers.integrations import is_deepspeed_available; \
		assert deepspeed.__version__.endswith('+shardwise') and is_deepspeed_available(), deepspeed.__file__; \
		print('gpu-install: deepspeed', deepspeed.__version__, 'and shardwise from', shardwise.__file__)"

test-gpu: $(if $(filter 1,$(GPU_INSTALL)),gpu-install)
	@mkdir -p "$(GPU_OUT)"
	@$(GPU_PYTHON) tools/gpu_report.py --env
	status=0; timeout -s INT -k 30 $(GPU_TIMEOUT) $(GPU_PYTHON) -m pytest tests/gpu -q -rs -p no:cacheprovider \
		--junitxml="$(GPU_OUT)/test-gpu.xml" || status=$$?; \
	$(GPU_PYTHON) tools/gpu_report.py "$(GPU_OUT)/test-gpu.xml" --out "$(GPU_OUT)/test-gpu.json" \
		--status $$status; exit $$status

clean:
	rm -rf $(VENV) $(DS_VENV) checkpoints runs .pytest_cache

# LoRA fine-tuning of a tiny LLaMA under ZeRO-3 (examples/finetune_llm/README.md): a briefly pretrained base,
# then the adapter on the bundled prompt/response pairs, then greedy completions from the merged weights.
FT := checkpoints/finetune_llm
finetune-demo: $(STAMP)
	test -f $(FT)/base/model.safetensors || $(BIN)/python examples/finetune_llm/make_assets.py --skip_bundled --base $(FT)/base
	$(BIN)/shardwise --num_gpus $(NUM_PROCS) examples/finetune_llm/train.py --model $(FT)/base --output_dir $(FT)/out --merge
	$(BIN)/python examples/finetune_llm/generate.py --model $(FT)/out/merged
