# Every target sets itself up: a fresh machine with Python 3.11 needs nothing else.
# bash with pipefail: a recipe that pipes a failing command into grep or tee fails too.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test bytecode test-deploy base-image lint typecheck bench bench-store bench-edge bench-dataset bench-planner bench-peers bench-wan bench-schedule bench-staging bench-images bench-text bench-training wan-tools chaos lock proto clean

demo: $(STAMP) bytecode  ## run the local end-to-end demo on generated data
	$(VENV)/bin/edgecache demo

# Tests run in parallel (pytest-xdist), one worker more than the cores this may run on, at most
# 4: most of them wait on real nodes, sockets and subprocesses, so with one worker per core the
# two cores here stayed ~17 % idle. On this 2-core machine (2026-12-07) three workers ran the
# suite in 606-713 s (three runs), two in 732-820 s (four runs), every test passing each time.
# WORKERS=2 make test to choose. One file alone: .venv/bin/pytest tests/<file>.py (serial).
WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(len(os.sched_getaffinity(0)) + 1, 4))')
test: $(STAMP) bytecode  ## run the whole test suite (bin/pytest: python -m would put the checkout on sys.path)
	$(VENV)/bin/pytest -n $(WORKERS)

# The checkout's own modules compiled once, before the processes that import them: the
# suite starts ~900 Python processes (nodes, CLIs, children), and where
# PYTHONDONTWRITEBYTECODE is set (this machine's environment sets it) each compiled every
# edgecache module it imported again, ~0.2 CPU-s a process. Reading .pyc files is not
# affected by that variable; stale ones are recompiled here (by their source's mtime).
bytecode: $(STAMP)
	$(PY) -m compileall -q -j 0 cache clients edge proto bench

# Containers for real: a Docker engine (installed and started here when missing, as root),
# the local Debian base (debootstrap + docker import; no registry needed), the images, and
# deploy/compose.host.yaml run and driven from the host by tests/deploy, then restarted whole by
# tests/test_deploy_walk.py (its own project, after the first stack is down). Skipped, loudly,
# only where no Docker engine can be had. DEPLOY_BASE_IMAGE=python:3.11-slim where a registry is.
DEPLOY_BASE_IMAGE ?= edgecache-base:bookworm
test-deploy: $(STAMP)  ## build the images and run the compose stack on a real Docker engine
	@export EDGECACHE_DEPLOY_STARTED=$$(date +%s); \
	if ! deploy/base-image/docker-engine.sh; then \
		printf '\n%s\n%s\n%s\n\n' "$$(printf '!%.0s' {1..78})" \
			"!! test-deploy SKIPPED: no Docker engine could be started here (see above)." \
			"$$(printf '!%.0s' {1..78})"; \
		exit 0; \
	fi; \
	if [ "$(DEPLOY_BASE_IMAGE)" = edgecache-base:bookworm ]; then \
		EDGECACHE_BASE_IMAGE=$(DEPLOY_BASE_IMAGE) deploy/base-image/build.sh; fi; \
	EDGECACHE_DEPLOY_TESTS=1 EDGECACHE_BASE_IMAGE=$(DEPLOY_BASE_IMAGE) \
		$(VENV)/bin/pytest -o timeout=900 -p no:cacheprovider tests/deploy \
	&& EDGECACHE_DEPLOY_TESTS=1 EDGECACHE_BASE_IMAGE=$(DEPLOY_BASE_IMAGE) \
		$(VENV)/bin/pytest -o timeout=1200 -p no:cacheprovider tests/test_deploy_walk.py

base-image:  ## the local Debian base image (debootstrap + docker import), unless it exists
	deploy/base-image/docker-engine.sh
	EDGECACHE_BASE_IMAGE=edgecache-base:bookworm deploy/base-image/build.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy cannot follow setuptools' editable import hook, so check an installed copy (built
# with the venv's own setuptools and grpcio-tools, which the dev extra pins).
typecheck: $(STAMP)
	rm -rf build/typecheck
	$(PY) -m pip install -q --no-deps --no-build-isolation --target build/typecheck .
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml \
		-p edgecache.cache -p edgecache.clients -p edgecache.edge

bench: $(STAMP) wan-tools  ## every benchmark in one run; prints the summary, rewrites docs/benchmarks.md + charts
	$(PY) -m bench $(BENCH_ARGS)

# bench.wan builds its link from network namespaces, tc and iptables (NFQUEUE); without
# iptables or root it falls back to a delaying proxy and says so.
wan-tools:
	@command -v iptables >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -q iptables >/dev/null; } \
		|| echo "no iptables here: bench.wan will use its proxy link (no packet loss)"

bench-store: $(STAMP)  ## codec and LMDB store against raw zstd / raw LMDB
	$(PY) -m bench.codec_store

bench-edge: $(STAMP)  ## edge node ReadShard and staging against bare grpcio / aiobotocore
	$(PY) -m bench.edge_node

bench-dataset: $(STAMP)  ## EdgeDataset (gRPC and lmdb://) against a hand-written LMDB → tensor loop
	$(PY) -m bench.dataset

bench-planner: $(STAMP)  ## planner at 1k and 10k jobs x 1,000 versions x 20 regions
	$(PY) -m bench.planner

bench-peers: $(STAMP)  ## EdgeDataset against MosaicML Streaming, LitData and WebDataset
	$(PY) -m bench.peers

bench-staging: $(STAMP)  ## staging CPU per GB, scaling over cores, and staging from moto against bare GETs + decode
	$(PY) -m bench.staging

bench-images: $(STAMP)  ## image decoders per core, the images transform, and an epoch of edge-decoded images against LitData
	$(PY) -m bench.images

bench-text: $(STAMP)  ## the tokens transform (tokenise + pack) against bare tokenizers
	$(PY) -m bench.text

bench-training: $(STAMP)  ## shuffle quality, and the read cost of batch shuffle, mixtures, splits and elastic resume
	$(PY) -m bench.training

bench-schedule: $(STAMP) wan-tools  ## a simulated day of ~20 jobs in three regions: the controller against naive warming
	$(PY) -m bench.schedule

bench-wan: $(STAMP) wan-tools  ## staging and epochs across a simulated 80 ms / 100 Mbit/s / 0.1 % loss link
	$(PY) -m bench.wan

CHAOS_TESTS ?= tests/chaos
chaos: $(STAMP)  ## fault injection at full counts; prints the figures for docs/reliability.md
	EDGECACHE_CHAOS=full $(VENV)/bin/pytest -s -q $(CHAOS_TESTS) | grep -E "FIGURE|passed|failed|error"

lock:  ## pin the edge node image's dependencies (deploy/constraints.txt)
	rm -rf build/lock-venv
	$(PYTHON) -m venv build/lock-venv
	build/lock-venv/bin/pip install -q --upgrade pip
	# With the images and text extras: a node decodes and tokenises the versions
	# published with --transform images or tokens (Pillow, tokenizers).
	build/lock-venv/bin/pip install -q '.[images,text]'
	echo "# Edge node image dependencies, pinned: regenerate with 'make lock'." > deploy/constraints.txt
	build/lock-venv/bin/pip freeze --exclude edgecache >> deploy/constraints.txt

proto: $(STAMP)  ## regenerate edgecache.v1 after editing proto/**/*.proto
	$(PY) proto/generate.py

# torch==2.13.0 first: it is the CPU build on this disk; any looser spec may
# pull a multi-GB CUDA build. Users elsewhere may use any torch >= 2.2.
$(STAMP): pyproject.toml setup.py bench/requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[torch,dev]'
	# The benchmark peers, pinned and --no-deps: their declared requirements cannot be
	# met beside this project (see bench/requirements.txt); the tests smoke-run them.
	$(PY) -m pip install -q --no-deps -r bench/requirements.txt
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info proto/edgecache/v1/*_pb2*.py proto/edgecache/v1/*_pb2*.pyi
