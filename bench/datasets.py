"""Generated benchmark datasets, shaped like the two workloads edgecache serves."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENS_PER_SAMPLE = 2048
IMAGE_BYTES = 100 << 10
TEXT_VOCABULARY = 32_000  # a Llama- or Mistral-sized vocabulary


def tokens(total_bytes: int, *, seed: int = 0, batch_rows: int = 1024) -> list[pa.RecordBatch]:
    """LLM token samples: 2048 int32 ids (Zipf over a 50k vocabulary) and a label."""
    rng = np.random.default_rng(seed)
    rows = max(total_bytes // (TOKENS_PER_SAMPLE * 4), 1)
    out = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        ids = (rng.zipf(1.2, size=n * TOKENS_PER_SAMPLE) % 50_000).astype(np.int32)
        out.append(_token_batch(ids, start))
    return out


def _token_batch(ids: np.ndarray, first_label: int) -> pa.RecordBatch:
    """Rows of 2048 ids from ``ids`` (a whole number of rows), labelled from ``first_label``."""
    n = len(ids) // TOKENS_PER_SAMPLE
    return pa.record_batch(
        {
            "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids), TOKENS_PER_SAMPLE),
            "label": pa.array(np.arange(first_label, first_label + n, dtype=np.int64)),
        }
    )


def bpe(texts: list[str], vocabulary: int) -> Tokenizer:
    """A byte-level BPE of ``vocabulary`` ids trained on ``texts``: no download, any byte.

    Its first ids are the special tokens ``<pad>``, ``<unk>`` and ``</s>`` (what
    bench.text gives the ``tokens`` transform as ``eos``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocabulary,
        special_tokens=["<pad>", "<unk>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def text_tokens(
    total_bytes: int, *, vocabulary: int = TEXT_VOCABULARY, batch_rows: int = 1024
) -> list[pa.RecordBatch]:
    """Token ids of real text: the standard library's sources, each file once.

    Tokenised by a byte-level BPE of ``vocabulary`` ids trained here on the same
    sources (no download) and packed into rows of 2048 int32 ids, as the ``tokens``
    transform packs them. The Zipf ids of :func:`tokens` are drawn independently
    and never repeat a phrase; real token streams do (code, boilerplate, quoted
    text), which is what a compressor's match finder is for: a codec tuned on the
    Zipf ids alone stored these 13 % larger. Capped at what the sources give
    (about 24 MB of ids per 24 MB of text) and never repeated to fill
    ``total_bytes``: a repeated corpus would give the compressor matches no real
    corpus has.
    """
    want_chars = total_bytes  # ~4 characters per token, 4 bytes per id
    texts: list[str] = []
    chars = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        chars += len(text)
        if chars >= want_chars:
            break
    tokenizer = bpe(texts, vocabulary)
    ids = np.concatenate([np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(texts)])
    rows = min(len(ids) // TOKENS_PER_SAMPLE, max(total_bytes // (TOKENS_PER_SAMPLE * 4), 1))
    out = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        out.append(
            _token_batch(ids[start * TOKENS_PER_SAMPLE : (start + n) * TOKENS_PER_SAMPLE], start)
        )
    return out


def images(total_bytes: int, *, seed: int = 0, batch_rows: int = 64) -> list[pa.RecordBatch]:
    """Image-like samples: ~100 KiB of half-noise, half-gradient bytes and an int label."""
    rng = np.random.default_rng(seed)
    rows = max(total_bytes // IMAGE_BYTES, 1)
    gradient = (np.arange(IMAGE_BYTES // 2) // 97 % 256).astype(np.uint8).tobytes()
    out = []
    for start in range(0, rows, batch_rows):
        n = min(batch_rows, rows - start)
        noise = rng.integers(0, 256, size=(n, IMAGE_BYTES // 2), dtype=np.uint8)
        blobs = [noise[i].tobytes() + gradient for i in range(n)]
        out.append(
            pa.record_batch(
                {
                    "image": pa.array(blobs, type=pa.binary()),
                    "label": pa.array(rng.integers(0, 1000, size=n, dtype=np.int64)),
                }
            )
        )
    return out
