# recpipe — `make demo` and `make test` are the two commands; everything else is optional.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RECPIPE := $(VENV)/bin/recpipe
STAMP := $(VENV)/.recpipe-setup
export NUMBA_CACHE_DIR ?= $(CURDIR)/.numba_cache

# `make etl` knobs: leave INPUT empty to generate synthetic logs first.
INPUT ?=
EVENTS ?=
SCHEMA ?=
OUT ?= data/demo
REQUESTS ?= 200000
SHARDS ?= 8
EPOCHS ?= 1
BATCH ?= 1024
DEDUP ?= on
PORT ?= 7777
READERS ?= 2

.PHONY: setup demo etl stats serve train bench test test-fast lint format clean help

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | column -t -s $$'\t'

setup: $(STAMP)  ## create .venv (torch==2.13.0 CPU first, then recpipe[dev,cuda,torchrec])

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: anything else would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,cuda,torchrec]'
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
	$(RECPIPE) etl build $(OUT)/shards $${evs:+--events $$evs} --out $(OUT)/dataset $$schema_arg --overwrite; \
	$(RECPIPE) stats $(OUT)/dataset --out $(OUT)/stats $$schema_arg

stats: setup  ## DuckDB duplication statistics of OUT/dataset
	$(RECPIPE) stats $(OUT)/dataset --out $(OUT)/stats

serve: setup  ## serve OUT/dataset's preprocessed batches over TCP (127.0.0.1; PORT=..., READERS=...)
	$(RECPIPE) serve $(OUT)/dataset --port $(PORT) --readers $(READERS)

train: setup  ## train the DLRM on OUT/dataset (DEDUP=on|off, EPOCHS=..., BATCH=...)
	$(RECPIPE) train $(OUT)/dataset --dedup $(DEDUP) --epochs $(EPOCHS) --batch-size $(BATCH) \
	  --checkpoint $(OUT)/checkpoints

bench: setup  ## run every benchmark; JSON lands in benchmarks/results/
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
	@echo "== benchmarks/etl.py, out of core (raw logs ~4.7x the memory limit)"
	$(PY) benchmarks/etl.py --memory-limit 512MB --requests 2200000

test: setup  ## the whole suite, slow tests included (what CI runs)
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -n 2 --dist loadfile -q

test-fast: setup  ## skip tests marked slow
	NUMBA_ENABLE_CUDASIM=1 $(PY) -m pytest -n 2 --dist loadfile -q -m "not slow"

lint: setup  ## ruff check + format check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .numba_cache .pytest_cache data build *.egg-info
