# recpipe — `make demo` and `make test` are the two commands; everything else is optional.
SHELL := /bin/bash
## PYTHON    the interpreter `make setup` makes .venv from (default python3)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RECPIPE := $(VENV)/bin/recpipe
STAMP := $(VENV)/.recpipe-setup
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

# Knobs: `make help` lists them from the `##` line above each.
## INPUT     raw feature logs for `make etl`: JSON Lines or Parquet, see docs/data-contract.md (empty: generate synthetic logs first)
INPUT ?=
## EVENTS    raw event logs (labels) for `make etl` with INPUT
EVENTS ?=
## SCHEMA    dataset schema TOML (default: the bundled schemas/examples/synth.toml)
SCHEMA ?=
## OUT       where `make etl/stats/train/serve` read and write (default data/demo)
OUT ?= data/demo
## REQUESTS  synthetic requests `make etl`/`make demo` generate without INPUT (default 200000)
REQUESTS ?= 200000
## SHARDS    session shards `make etl` routes the logs to (default 8)
SHARDS ?= 8
## ROW_GROUP_SIZE  most rows per row group of `make etl` (default 65536; small datasets get smaller groups)
ROW_GROUP_SIZE ?= 65536
## EVAL_FRACTION   share held out for evaluation by `make train` (default 0.1)
EVAL_FRACTION ?= 0.1
## EPOCHS    passes over the data in `make train` (default 1)
EPOCHS ?= 1
## BATCH     rows per batch in `make train`, and the B of `make etl`/`make stats`'s dedup factors (default 1024)
BATCH ?= 1024
## DEDUP     on or off: `make train` with or without deduplication (default on)
DEDUP ?= on
## PORT      TCP port of `make serve` (default 7777)
PORT ?= 7777
## READERS   reader processes of `make serve` (default 2)
READERS ?= 2
# What `make demo` writes under data/demo (`make clean-demo` removes exactly these).
DEMO_OUTPUTS := raw shards dataset stats checkpoints

.PHONY: setup demo etl stats serve train bench test test-fast lint format clean clean-demo help

help:  ## list targets and knobs
	@echo "targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t' | sed 's/^/  /'
	@echo "knobs (make <target> NAME=value):"
	@grep -E '^## [A-Z_]+ ' $(MAKEFILE_LIST) | sed -E 's/^## /  /'

setup: $(STAMP)  ## create .venv (torch==2.13.0 CPU first, then recpipe[dev,cuda,torchrec,spark])

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: anything else would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,cuda,torchrec,spark]'
	# torchrec's metadata asks for the CUDA fbgemm-gpu; its CPU build comes with the extra above.
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	@touch $(STAMP)

demo: setup  ## synth -> shard -> build -> stats -> a short training run, on the bundled schema
	$(MAKE) --no-print-directory etl OUT=data/demo REQUESTS=$(REQUESTS)
	$(MAKE) --no-print-directory train OUT=data/demo

etl: setup  ## raw logs -> clustered zstd Parquet + stats (INPUT=..., EVENTS=..., SCHEMA=..., OUT=...)
	@set -e; \
	if [ -z "$(INPUT)" ]; then \
	  $(RECPIPE) synth --out $(OUT)/raw --requests $(REQUESTS); \
	  feats=$(OUT)/raw/features; evs=$(OUT)/raw/events; \
	else feats="$(INPUT)"; evs="$(EVENTS)"; fi; \
	schema_arg="$(if $(SCHEMA),--schema $(SCHEMA),)"; \
	$(RECPIPE) etl shard $$feats --out $(OUT)/shards --num-shards $(SHARDS) $$schema_arg --overwrite; \
	$(RECPIPE) etl build $(OUT)/shards $${evs:+--events $$evs} --out $(OUT)/dataset $$schema_arg \
	  --row-group-size $(ROW_GROUP_SIZE) --overwrite; \
	$(RECPIPE) stats $(OUT)/dataset --out $(OUT)/stats $$schema_arg --batch-size $(BATCH)

stats: setup  ## DuckDB duplication statistics of OUT/dataset
	$(RECPIPE) stats $(OUT)/dataset --out $(OUT)/stats --batch-size $(BATCH)

serve: setup  ## serve OUT/dataset's preprocessed batches over TCP (127.0.0.1; PORT=..., READERS=...)
	$(RECPIPE) serve $(OUT)/dataset --port $(PORT) --readers $(READERS)

train: setup  ## train the DLRM on OUT/dataset, replacing OUT/checkpoints (DEDUP=on|off, EPOCHS=..., BATCH=..., EVAL_FRACTION=...)
	$(RECPIPE) train $(OUT)/dataset --dedup $(DEDUP) --epochs $(EPOCHS) --batch-size $(BATCH) \
	  --eval-fraction $(EVAL_FRACTION) --checkpoint $(OUT)/checkpoints --overwrite

bench: setup  ## run every benchmark (JSON in benchmarks/results/), then write the README's tables from it
	@for b in $(basename $(notdir $(filter-out benchmarks/report.py,$(wildcard benchmarks/[a-z]*.py)))); do \
	  echo "== benchmarks.$$b"; $(PY) -m benchmarks.$$b || exit 1; done
	@echo "== benchmarks.etl, out of core (raw logs ~4.7x the memory limit)"
	$(PY) -m benchmarks.etl --memory-limit 512MB --requests 2200000
	$(PY) -m benchmarks.report

test: setup  ## the whole suite, slow tests included (what CI runs)
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -n 2 --dist loadfile -q

test-fast: setup  ## skip tests marked slow
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -n 2 --dist loadfile -q -m "not slow"

lint: setup  ## ruff check + format check + the import layering (lint-imports) + mypy --strict on recpipe/ and schemas/
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: setup  ## ruff: fix what it can, then format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:  ## remove what setup, tests and builds made (.venv, caches); never data/
	rm -rf $(VENV) .numba_cache .pytest_cache .ruff_cache .hypothesis build *.egg-info
	find . -name __pycache__ -type d -not -path './.git/*' -prune -exec rm -rf {} +

clean-demo:  ## remove what `make demo` wrote under data/demo (nothing else in data/)
	rm -rf $(addprefix data/demo/,$(DEMO_OUTPUTS))
	-rmdir data/demo 2>/dev/null
