# The README's two commands: `make demo` and `make test`. Both run `make install` first, which
# is idempotent and skipped when nothing it depends on changed.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed
INSTALL_INPUTS := pyproject.toml setup.py scripts/install.sh $(wildcard workers/fabric/_build.py workers/fabric/csrc/* workers/engine/attention/_build_cpu.py workers/engine/attention/csrc/* workers/engine/fused/csrc/*)
PROTO_SRCS := $(wildcard protos/pdserve/v1/*.proto)
PROTO_STUBS := $(PROTO_SRCS:.proto=_pb2.py)
export RAY_USAGE_STATS_ENABLED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test lint lint-protos typecheck unit demo bench bench-peers bench-serving soak clean

install: $(STAMP) $(PROTO_STUBS)

$(STAMP): $(INSTALL_INPUTS)
	@bash scripts/install.sh
	@touch $(STAMP)

# The install's build generates the stubs; this regenerates them when a .proto changed since.
$(PROTO_STUBS) &: $(PROTO_SRCS) protos/_build.py scripts/gen_protos.sh | $(STAMP)
	@bash scripts/gen_protos.sh

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(PY) -m pytest -m "not bench"

lint-protos: install
	bash scripts/lint_protos.sh

test: lint lint-protos typecheck unit

demo: install
	$(PY) -m orchestrator.cli demo

bench: install
	$(PY) bench/engine.py
	$(PY) bench/fabric.py
	$(PY) bench/router.py
	$(PY) bench/transfer.py

# vLLM's CPU build for this CPU in a venv of its own (.cache/peers/), the peer of bench/engine.py --peer vllm.
bench-peers:
	bash bench/peers/setup_vllm.sh

# pdserve serve against vllm serve under load, one client (vLLM's); needs bench-peers.
bench-serving: install
	$(PY) bench/serving.py --json bench/out/serving.json

# The long soak: 10 minutes of mixed traffic, random cancels, 4 worker kills.
soak: install
	$(PY) bench/soak.py --duration 600 --kills 4 --json .cache/soak.json

clean:
	rm -rf build *.egg-info .pytest_cache .mypy_cache .ruff_cache
