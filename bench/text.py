"""Tokenise + pack at the edge: the tokens transform against bare ``encode_batch``.

    python -m bench.text [--mib 16] [--repeat 3] [--json]

Text: the Python standard library's own sources (``*.py`` under the stdlib
directory), as JSON Lines documents, repeated to ``--mib`` MiB. Tokenizer: a
byte-level BPE (vocabulary 8,192) trained in this run on those sources (no
download). Measured in one run, best of ``--repeat``:

* baseline: ``Tokenizer.encode_batch_fast`` over the documents, called once
  with the library's own thread pool on (``TOKENIZERS_PARALLELISM=true``), its
  fastest here, nothing else (no parsing, no packing);
* the tokens transform (parse JSON Lines, tokenise, pack into 2,048-token rows
  with document starts) as ``edgecache serve`` runs it: the library's pool off
  (``tokenise_on_callers_threads``), on one thread and on a parts pool of every
  core;
* the transform on every core with the library's pool on, as nodes ran it
  before stop 37: its threads and the node's then contend for the same cores.

Reported as MB/s of text and tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sysconfig
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from bench import datasets, report
from bench.arguments import positive_int, require_modules
from edgecache.cache.preprocess import ShardContext, load_transform, preprocess
from edgecache.edge.config import usable_cores
from edgecache.v1 import manifest_pb2 as pb

__all__ = ["main"]

PARALLELISM = "TOKENIZERS_PARALLELISM"


def corpus(mib: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            docs.append(path.read_text())
        except (UnicodeDecodeError, OSError):
            continue
    out: list[str] = []
    size = 0
    while size < mib << 20:  # the sources again, stopping at the size asked for
        for doc in docs:
            out.append(doc)
            size += len(doc)
            if size >= mib << 20:
                break
    return out


def train(docs: list[str]) -> bytes:
    """The tokenizer file the transform is given: a BPE of 8,192 ids trained on ``docs``."""
    return datasets.bpe(docs, 8192).to_str().encode()


@contextlib.contextmanager
def _library_pool(on: bool) -> Iterator[None]:
    """tokenizers' own thread pool on or off inside (it reads the variable at every call)."""
    before = os.environ.get(PARALLELISM)
    os.environ[PARALLELISM] = "true" if on else "false"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PARALLELISM]
        else:
            os.environ[PARALLELISM] = before


def run(mib: int, repeat: int, console: Console) -> dict:
    from tokenizers import Tokenizer

    console.log(f"reading the standard library's sources into {mib} MiB of documents")
    docs = corpus(mib)
    console.log("training a byte-level BPE tokenizer on them")
    tok_json = train(docs[:400])
    tokenizer = Tokenizer.from_str(tok_json.decode())
    data = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)
    text_bytes = sum(len(d.encode()) for d in docs)
    spec = pb.PreprocessSpec(
        transform="tokens", params={"tokenizer": "t", "seq_len": "2048", "eos": "</s>"}
    )

    def bare() -> tuple[float, int]:
        started = time.perf_counter()
        encoded = tokenizer.encode_batch_fast(docs, add_special_tokens=False)
        return time.perf_counter() - started, sum(len(e.ids) for e in encoded)

    # Built once, outside the timer, as the bare side's tokenizer is (a node builds a
    # version's transform once too).
    transform = load_transform(spec.transform, spec.params, {"t": tok_json})

    def ours(threads: int) -> tuple[float, int]:
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            rows = sum(
                b.num_rows
                for b in preprocess(
                    data,
                    fmt=pb.SOURCE_FORMAT_JSONL,
                    source="bench",
                    spec=spec,
                    transform=transform,
                    context=ShardContext(),
                    pool=pool if threads > 1 else None,
                )
            )
            return time.perf_counter() - started, rows * 2048

    cores = usable_cores()
    # Each side in the setting it runs in: the bare call with the library's own thread
    # pool (its fastest here), the transform as `edgecache serve` runs it (that pool off,
    # tokenise_on_callers_threads), and once more with the pool on, as nodes did before.
    sides: dict[str, tuple[Callable[[], tuple[float, int]], bool]] = {
        "bare": (bare, True),
        "one": (lambda: ours(1), False),
        "all": (lambda: ours(cores), False),
        "all_pool_on": (lambda: ours(cores), True),
    }
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in sides}
    for _ in range(repeat):  # interleaved, so drift hits all alike
        for key, (side, pool_on) in sides.items():
            with _library_pool(pool_on):
                runs[key].append(side())
    best = {k: min(v) for k, v in runs.items()}
    out = {
        "text_mb": round(text_bytes / 1e6, 1),
        "documents": len(docs),
        "tokens": best["bare"][1],
        "cores": cores,
    }
    labels = {
        "bare": "encode_batch_fast alone (the library's thread pool on)",
        "one": "tokens transform, one thread",
        "all": f"tokens transform as a node runs it (parts pool of {cores}, library pool off)",
        "all_pool_on": f"tokens transform, parts pool of {cores}, library pool on (before stop 37)",
    }
    for key, label in labels.items():
        seconds, _ = best[key]
        out[label] = {
            "text_mb_s": round(text_bytes / seconds / 1e6, 2),
            "tokens_s": round(best["bare"][1] / seconds),
        }
    out["transform_no_pool_vs_bare"] = round(best["bare"][0] / best["one"][0], 2)
    out["transform_pool_vs_bare"] = round(best["bare"][0] / best["all"][0], 2)
    out["scaling"] = round(best["one"][0] / best["all"][0], 2)
    out["library_pool_off_vs_on"] = round(best["all_pool_on"][0] / best["all"][0], 2)
    out["versions"] = report.versions("tokenizers", "pyarrow", "edgecache")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=positive_int, default=16)
    parser.add_argument("--repeat", type=positive_int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    require_modules(parser, ("tokenizers",), "bench.text")
    console = Console(stderr=args.json, width=150)
    results = run(args.mib, args.repeat, console)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for key, value in results.items():
        console.print(f"{key}: {value}")


if __name__ == "__main__":
    main()
