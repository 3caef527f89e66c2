"""The ``edgecache`` command line: operate caches and run the demo.

Each module holds one group of commands and reads as: parse the options,
call :mod:`edgecache.clients.ops` (or the registry), render the result.
:mod:`.context` holds what every command shares (the topology and token
options, exit codes, and the one place errors become messages);
:mod:`.render` holds tables and formatting.
"""

from __future__ import annotations

import os

from edgecache.clients.arrow_pool import ARROW_POOL_OPTIONS  # imports nothing

# gRPC core logs a failed TLS handshake at INFO ("Handshake failed … CERTIFICATE_VERIFY_FAILED"),
# one line per connection, before the command's own message says the same with what to set.
# ERROR keeps gRPC's errors, as the node's image does; GRPC_VERBOSITY set by the user wins.
# Read when gRPC starts (its first channel or server), which none has yet at this import.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# MIMALLOC_PURGE_DELAY. Arrow's default pool (mimalloc) gives freed pages back to the kernel
# 10 ms after they are freed, so a node staging shard after shard on two threads faulted in
# and zeroed each shard's decode buffers again: the kernel's page clearing took 5-13 % of
# the node's CPU (perf, 512 MiB of token Parquet staged on 2 cores). A second was not enough
# either: mimalloc (3.x, pyarrow 26) purges all of an arena's free memory once the first
# purge it scheduled is due, however recently the rest was freed, and its arena is madvised
# for transparent huge pages, so every purged 2 MiB is zeroed again whole at its next use
# (kernel clear_page under do_huge_pmd_anonymous_page: 20-33 % of a 2-core node's CPU in its
# slow rounds; a 2-core node, two shards' buffers in flight, refaulted twice what a 1-core
# one did, so it spent 10-40 % more CPU per GB; with no purge both spent the same). Ten
# seconds keeps the pages while a node stages and still returns them soon after staging ends
# (docs/preprocessing.md). Read when pyarrow loads, which nothing above this package has
# made it do; a value the user set wins. Every command gets it (short-lived ones never
# notice); a training process, which never imports the CLI, keeps Arrow's default.
os.environ.setdefault("MIMALLOC_PURGE_DELAY", ARROW_POOL_OPTIONS["MIMALLOC_PURGE_DELAY"])
# MIMALLOC_ALLOW_THP. The purge delay only helps while Stages follow each other: a fresh
# node faulted its buffers in as transparent huge pages, each zeroed whole (clear_page_erms
# under do_huge_pmd_anonymous_page, 41 % of a fresh node's first Stage), so that Stage cost
# 24-47 CPU-s/GB where a settled one costs 10; a node pinned to one core paid it again at
# every Stage after its idle release gave the pages back (edge/idle_memory.py: 21-24 against
# 12-13 CPU-s/GB). With huge pages off (mimalloc's allow_thp=0, which turns them off for the
# whole process: prctl PR_SET_THP_DISABLE) a fresh node's first Stage ran about twice as
# fast, settled ones the same, with no more memory (bench.staging (e) measures a first Stage
# and one after an idle release both ways in one run). Read and overridden as above.
os.environ.setdefault("MIMALLOC_ALLOW_THP", ARROW_POOL_OPTIONS["MIMALLOC_ALLOW_THP"])
# OPENBLAS_NUM_THREADS. numpy's OpenBLAS starts a thread for every core but one as numpy
# loads, and no edgecache command does linear algebra (torch, in the demo, uses MKL and
# its own threads): on this 2-core machine those threads cost a command ~0.1 CPU-s of its
# ~0.7 before it did anything (`edgecache status --help`, six runs each way), and a node
# on a 64-core host would start 63 of them. One thread, numpy's own, where the user set
# nothing. Read when numpy loads, which nothing above this package has made it do.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from edgecache.clients.cli.app import app, main  # noqa: E402

# Importing a command module registers its commands; --help lists them in this order.
# isort: off
from edgecache.clients.cli import demo, publishing, staging, controlling, nodes  # noqa: F401
# isort: on

__all__ = ["app", "main"]
