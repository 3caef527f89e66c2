"""The ``tokens`` transform: a text column → fixed-length token sequences, packed, at the edge.

LLM pretraining reads token ids in fixed-length blocks, documents packed end
to end (LitData's ``TokensLoader``, Megatron, nanoGPT). This transform
tokenises a text column once, on the node, with a Hugging Face ``tokenizers``
tokenizer, and packs the tokens of a shard's documents, in order, into rows of
``seq_len`` tokens:

* ``input_ids``: ``fixed_size_list<int32 | uint16 | uint32 | int64, seq_len>``
  → ``[B, seq_len]`` tensors in EdgeDataset;
* ``doc_starts``: ``list<int32>``, where a document begins inside the row (a
  row that continues the previous row's document does not list 0; a document
  with no tokens is not listed), so attention masks can be built per document;
* ``length``: the real tokens in the row (``seq_len`` except a padded last row).

Params:

* ``tokenizer``: a ``tokenizer.json`` file, as a key under the dataset's source
  prefix (shipped with the dataset; it is not published as a shard) or any URL
  origin serves (``s3://…/tokenizer.json``); publish records its SHA-256
  (``tokenizer_sha256``) and nodes refuse a file that differs;
* ``column`` (default ``text``), ``seq_len`` (default 2048);
* ``eos`` / ``bos``: a token (e.g. ``</s>``) added after / before each
  document; unset: none;
* ``dtype``: ``int32`` (default), ``uint16`` (vocabularies under 65,536:
  half the bytes to store, send and decompress), ``uint32``, ``int64``;
* ``remainder``: ``pad`` (default: the shard's last row is padded with
  ``pad_id``, default 0, and ``length`` says how much is real) or ``drop``.

Rows never span shards, so a node packs each shard alone and the packing is
the same on every node. Tokenising runs on the node's preprocessing threads,
one slice of documents (about 64 Ki characters) per task, with
``encode_batch_fast`` (no character offsets; it releases the GIL). A node
process turns the tokenizers library's own Rust thread pool off
(:func:`tokenise_on_callers_threads`): that pool's threads are not the node's,
so their CPU escaped the per-shard CPU the node's staging rate is computed
from, and beside the node's threads they were slower, not faster
(``bench.text``). Publishing a version with this transform tokenises every
object once to count its rows.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from edgecache.cache.preprocess.arrow_types import check_param_names
from edgecache.cache.preprocess.byte_types import is_text
from edgecache.cache.preprocess.context import shard_context
from edgecache.cache.preprocess.fixes import MissingColumn, ParamMismatch

__all__ = ["TokensSpec", "tokenise_on_callers_threads", "tokens_transform"]

_PARAMS = ("tokenizer", "tokenizer_sha256", "column", "seq_len", "eos", "bos", "dtype",
           "remainder", "pad_id")  # fmt: skip
_DTYPES: dict[str, type[np.integer[Any]]] = {
    "int32": np.int32,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "int64": np.int64,
}
_TASK_CHARS = 64 << 10  # text per task handed to a preprocessing thread
_PARALLELISM = "TOKENIZERS_PARALLELISM"  # read by tokenizers at every call


def tokenise_on_callers_threads() -> bool:
    """Turn the tokenizers library's Rust thread pool off in this process, unless set.

    For a node process (``edgecache serve``), never a library import: the
    variable is the process owner's. With the pool on, ``encode_batch_fast``
    hands a call's documents to threads of the library's own, so the node's
    thread CPU clocks, which its staging rate is computed from, missed nearly
    all the tokenising, and the planner was promised a rate the node did not
    have. Off, each call runs on the preprocessing thread that made it, niced
    like the rest of staging, and the node's threads share the cores:
    ``python -m bench.text`` on 2 cores, 16 MiB of text, the transform with
    its parts pool read 7.8 MB/s with the library's pool off against 6.4 with
    it on (two pools contending for two cores), 0.94x a bare
    ``encode_batch_fast`` with the pool on (8.3). An operator who sets the
    variable keeps their value. True when this call turned it off.
    """
    if _PARALLELISM in os.environ:
        return False
    os.environ[_PARALLELISM] = "false"
    return True


@dataclass(frozen=True, slots=True)
class TokensSpec:
    """The validated params of one ``tokens`` transform."""

    column: str
    seq_len: int
    dtype: str
    pad: bool
    pad_id: int

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> TokensSpec:
        """Read params; ValueError naming the bad one and what is allowed."""
        check_param_names("tokens", params, _PARAMS)
        if not params.get("tokenizer"):
            raise ValueError(
                "tokens transform needs tokenizer=KEY (a tokenizer.json under the source prefix) "
                "or tokenizer=URL"
            )
        seq = params.get("seq_len", "2048").strip()
        if not seq.isdigit() or not 1 <= int(seq) <= 1 << 20:
            raise ValueError(f"tokens param seq_len={seq!r}: expected 1..{1 << 20}")
        dtype = params.get("dtype", "int32").strip().lower()
        if dtype not in _DTYPES:
            raise ValueError(f"tokens param dtype={dtype!r}: use one of {', '.join(_DTYPES)}")
        remainder = params.get("remainder", "pad").strip().lower()
        if remainder not in ("pad", "drop"):
            raise ValueError(f"tokens param remainder={remainder!r}: use pad or drop")
        pad = params.get("pad_id", "0").strip()
        if not pad.isdigit():
            raise ValueError(f"tokens param pad_id={pad!r}: expected a token id")
        if int(pad) > np.iinfo(_DTYPES[dtype]).max:
            raise ValueError(
                f"tokens param pad_id={pad} does not fit dtype {dtype}; use a smaller pad_id "
                "or a wider dtype"
            )
        return cls(params.get("column") or "text", int(seq), dtype, remainder == "pad", int(pad))


def sha256_hex(data: bytes) -> str:
    """The digest publish records for a tokenizer file."""
    return hashlib.sha256(data).hexdigest()


def _load_tokenizer(params: Mapping[str, str], resources: Mapping[str, bytes]) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ValueError(
            "the tokens transform needs the tokenizers package: pip install 'edgecache[text]'"
        ) from exc
    ref = params["tokenizer"]
    if ref not in resources:
        raise ValueError(f"tokens transform: the tokenizer file {ref!r} was not fetched")
    data = resources[ref]
    want = params.get("tokenizer_sha256")
    if want and sha256_hex(data) != want:
        raise ValueError(
            f"tokenizer {ref!r} has SHA-256 {sha256_hex(data)}, but this version was published "
            f"with {want}: it changed after publishing; publish a new version"
        )
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise ValueError(f"{ref!r} is not a tokenizers tokenizer.json ({exc})") from exc


class _Tokens:
    """The transform: ``stream`` packs a whole shard (rows depend on what came before)."""

    def __init__(self, spec: TokensSpec, tokenizer: Any, bos: int | None, eos: int | None) -> None:
        self.spec, self.tokenizer, self.bos, self.eos = spec, tokenizer, bos, eos
        self.dtype: np.dtype[Any] = np.dtype(_DTYPES[spec.dtype])
        self.schema = pa.schema(
            [
                pa.field("input_ids", pa.list_(pa.from_numpy_dtype(self.dtype), spec.seq_len)),
                pa.field("doc_starts", pa.list_(pa.int32())),
                pa.field("length", pa.int32()),
            ]
        )

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips character offsets (not needed here): measured 1.3-1.6x
        # faster than encode_batch, and unlike it, it runs in parallel from several threads.
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def _ids(self, batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
        """All the batch's tokens in order, and where each document starts among them."""
        context = shard_context()
        names = batch.schema.names
        if self.spec.column not in names:
            raise MissingColumn(
                f"tokens: column {self.spec.column!r} is missing (the text column is named by "
                f"column=NAME); the data has {', '.join(names)}"
            )
        column = batch.column(self.spec.column)
        if not is_text(column.type):
            raise ParamMismatch(f"tokens: column {self.spec.column!r} is {column.type}, not text")
        texts = [t or "" for t in column.to_pylist()]
        slices: list[tuple[list[str]]] = []
        start = size = 0
        for i, text in enumerate(texts):  # tasks of about _TASK_CHARS, so threads share evenly
            size += len(text)
            if size >= _TASK_CHARS or i + 1 == len(texts):
                slices.append((texts[start : i + 1],))
                start, size = i + 1, 0
        docs = [ids for part in context.map(self._encode, slices) for ids in part]
        extra = (self.bos is not None) + (self.eos is not None)
        lengths = np.fromiter((len(d) + extra for d in docs), np.int64, len(docs))
        starts = np.zeros(len(docs), np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        flat = np.empty(int(lengths.sum()), np.int64)
        for first, ids in zip(starts.tolist(), docs, strict=True):
            at = first
            if self.bos is not None:
                flat[at] = self.bos
                at += 1
            flat[at : at + len(ids)] = ids
            if self.eos is not None:
                flat[at + len(ids)] = self.eos
        # A document with no tokens (empty or null text, no bos/eos) begins nowhere: listing
        # it would repeat the next document's offset, or point into the padding.
        return flat, starts[lengths > 0]

    def _rows(self, flat: np.ndarray, starts: np.ndarray, final: int) -> pa.RecordBatch:
        """Rows of ``seq_len`` from ``flat`` (its length a multiple, or the padded last row)."""
        seq = self.spec.seq_len
        count = -(-len(flat) // seq)
        padded = np.full(count * seq, self.spec.pad_id, np.int64)
        padded[: len(flat)] = flat
        if padded.size and (padded.max() > np.iinfo(self.dtype).max or padded.min() < 0):
            raise ParamMismatch(
                f"tokens: token id {int(padded.max())} does not fit dtype {self.spec.dtype} "
                "(or pad_id does not); use a wider dtype"
            )
        rows = np.minimum(starts // seq, count - 1) if count else starts
        offsets = np.searchsorted(rows, np.arange(count + 1), side="left").astype(np.int32)
        doc_starts = pa.ListArray.from_arrays(
            pa.array(offsets), pa.array((starts - rows * seq).astype(np.int32))
        )
        lengths = np.full(count, seq, np.int32)
        if count and final % seq:
            lengths[-1] = final % seq
        ids = pa.FixedSizeListArray.from_arrays(pa.array(padded.astype(self.dtype)), seq)
        return pa.RecordBatch.from_arrays([ids, doc_starts, pa.array(lengths)], schema=self.schema)

    def stream(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Tokenise and pack a whole shard's batches, in order."""
        seq = self.spec.seq_len
        carry = np.empty(0, np.int64)  # tokens not yet in a full row
        carry_starts = np.empty(0, np.int64)  # document starts among them
        for batch in batches:
            flat, starts = self._ids(batch)
            flat = np.concatenate([carry, flat])
            starts = np.concatenate([carry_starts, starts + len(carry)])
            full = len(flat) // seq * seq
            if full:
                inside = starts < full
                yield self._rows(flat[:full], starts[inside], full)
                carry, carry_starts = flat[full:], starts[~inside] - full
            else:
                carry, carry_starts = flat, starts
        if len(carry) and self.spec.pad:
            yield self._rows(carry, carry_starts, len(carry))

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """One batch alone (its last row padded): for callers that do not stream."""
        flat, starts = self._ids(batch)
        return self._rows(flat, starts, len(flat))


def _token_id(tokenizer: Any, text: str | None, name: str) -> int | None:
    if not text:
        return None
    found = tokenizer.token_to_id(text)
    if found is None:
        raise ValueError(f"tokens param {name}={text!r} is not a token of this tokenizer")
    return int(found)


def tokens_transform(params: Mapping[str, str], resources: Mapping[str, bytes]) -> _Tokens:
    """The ``tokens`` transform for ``params``; ``resources`` holds the tokenizer file's bytes."""
    spec = TokensSpec.parse(params)
    tokenizer = _load_tokenizer(params, resources)
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    if vocab - 1 > np.iinfo(_DTYPES[spec.dtype]).max:  # refused at publish, not on every node
        wider = "uint32" if spec.dtype == "uint16" else "int64"
        raise ValueError(
            f"tokens: the tokenizer's vocabulary has {vocab:,} tokens, more than dtype "
            f"{spec.dtype} holds; use dtype={wider}"
        )
    return _Tokens(
        spec,
        tokenizer,
        _token_id(tokenizer, params.get("bos"), "bos"),
        _token_id(tokenizer, params.get("eos"), "eos"),
    )
