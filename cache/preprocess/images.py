"""The ``images`` transform: encoded JPEG/PNG/WebP → fixed-shape uint8 pixels, once, at the edge.

Image datasets otherwise reach GPU hosts as encoded blobs that every rank
decodes every epoch. This transform decodes each image once, on the node,
into a ``[height, width, channels]`` uint8 array stored as nested fixed-size
lists, which EdgeDataset turns into ``[B, H, W, C]`` uint8 tensors straight
into pinned memory (channels last, in ``R, G, B`` order; one channel for
``channels=gray``).

Params (``--param K=V``):

* ``column``: the encoded image column (default: the only binary column), or
  a field of a struct column by its path, ``image.bytes``: Hugging Face's
  ``Image()`` feature is ``struct<bytes: binary, path: string>`` in Parquet;
  the pixels then replace the whole struct column (``image``);
* ``size=N`` or ``height=H`` and ``width=W`` (each its own ``--param``; one way or
  the other);
* ``fit``: ``crop`` (default: scale so the image covers H×W, keep the centre)
  or ``pad`` (scale so it fits inside, centre it on ``fill``, default 0);
* ``channels``: ``rgb`` (default) or ``gray``;
* ``filter``: ``bilinear`` (default), ``bicubic``, ``lanczos``, ``box``, ``nearest``;
* ``on_error``: ``fail`` (default: the shard fails, naming the object and the
  sample) or ``skip`` (the sample is dropped and counted; publish then decodes
  every image once to count the rows that remain, and warns of those dropped);
* ``output``: the output column's name (default: ``column``, replaced);
* ``decoder``: recorded by publish (``pillow-13.0.0``): a node with another
  Pillow refuses, because another decoder may produce other pixels, and the
  same version must give the same bytes on every node.

Decoder: Pillow, measured against simplejpeg and others in ``bench.images``:
with JPEG DCT-domain downscaling (``Image.draft``) it decodes as fast as
simplejpeg, and it also reads PNG and WebP. Pillow releases the GIL while it
decodes and resizes, so the images of a batch are decoded on the node's
preprocessing threads in parallel (see :class:`~.transforms.ShardContext`).
EXIF orientation is not applied (torchvision's ``decode_jpeg`` does not either).
Alpha is dropped; 16-bit grayscale is scaled to 8 bits (Pillow alone would clip it).
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from edgecache.cache.errors import MalformedShard
from edgecache.cache.preprocess.arrow_types import check_param_names
from edgecache.cache.preprocess.byte_types import is_binary
from edgecache.cache.preprocess.context import shard_context
from edgecache.cache.preprocess.fixes import MissingColumn, ParamMismatch

__all__ = ["ImageSpec", "decoder_version", "image_type", "images_transform"]

_FITS = ("crop", "pad")
_FILTERS = ("bilinear", "bicubic", "lanczos", "box", "nearest")
_PARAMS = ("column", "size", "height", "width", "fit", "channels", "filter", "on_error", "output",
           "decoder", "fill")  # fmt: skip
_MAX_SIDE = 8192
ROWS_PER_BATCH = 512  # decoded rows per batch: ~77 MB at 224x224x3, bounded whatever the input
_PER_TASK = 16  # images per task handed to a preprocessing thread


def decoder_version() -> str:
    """``pillow-<version>``, what publish records and nodes must match."""
    import PIL

    return f"pillow-{PIL.__version__}"


def image_type(height: int, width: int, channels: int) -> pa.DataType:
    """``[height][width][channels]`` uint8 as nested fixed-size lists."""
    return pa.list_(pa.list_(pa.list_(pa.uint8(), channels), width), height)


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """The validated params of one ``images`` transform."""

    column: str | None
    height: int
    width: int
    fit: str
    channels: int
    filter: str
    skip: bool
    output: str | None
    fill: int

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> ImageSpec:
        """Read params; ValueError naming the bad one and what is allowed."""
        check_param_names("images", params, _PARAMS)

        for name in ("size", "height", "width"):
            if "=" in params.get(name, ""):  # height=224,width=160 in one --param
                raise ValueError(
                    f"images param {name}={params[name]!r}: give each param as its own "
                    "--param, e.g. --param height=224 --param width=160"
                )

        def side(name: str, text: str) -> int:
            if not text.strip().isdigit() or not 1 <= int(text) <= _MAX_SIDE:
                raise ValueError(f"images param {name}={text!r}: expected 1..{_MAX_SIDE} pixels")
            return int(text)

        if "size" in params:
            if "height" in params or "width" in params:
                raise ValueError(
                    "images: give size=N (--param size=N) or height and width "
                    "(--param height=H --param width=W), not both"
                )
            height = width = side("size", params["size"])
        elif "height" in params and "width" in params:
            height, width = side("height", params["height"]), side("width", params["width"])
        else:
            raise ValueError("images transform needs size=N (square) or height=H and width=W")
        choice = {k: params.get(k, d).strip().lower() for k, d in
                  (("fit", "crop"), ("channels", "rgb"), ("filter", "bilinear"),
                   ("on_error", "fail"))}  # fmt: skip
        for key, allowed in (("fit", _FITS), ("channels", ("rgb", "gray")), ("filter", _FILTERS),
                             ("on_error", ("fail", "skip"))):  # fmt: skip
            if choice[key] not in allowed:
                raise ValueError(
                    f"images param {key}={params[key]!r}: use one of {', '.join(allowed)}"
                )
        fill = params.get("fill", "0").strip()
        if not fill.isdigit() or int(fill) > 255:
            raise ValueError(f"images param fill={params['fill']!r}: expected 0..255")
        wanted = params.get("decoder")
        if wanted and wanted != decoder_version():
            raise ValueError(
                f"this version's images are decoded with {wanted}, but Pillow here is "
                f"{decoder_version()}: install {wanted.replace('-', '==', 1)} on every node "
                "so each produces the same pixels (publish records the decoder itself: leave "
                "the decoder param out when publishing)"
            )
        return cls(
            column=params.get("column") or None,
            height=height,
            width=width,
            fit=choice["fit"],
            channels=3 if choice["channels"] == "rgb" else 1,
            filter=choice["filter"],
            skip=choice["on_error"] == "skip",
            output=params.get("output") or None,
            fill=int(fill),
        )


def _centre_box(spec: ImageSpec, size: tuple[int, int]) -> tuple[float, float, float, float]:
    """The centred region of an image of ``size`` that scales to cover H×W exactly.

    Clamped to the image: in floating point the box of a side that fits exactly comes out a
    hair outside it (640x427 at 64: top = -7e-15), which Pillow refuses.
    """
    width, height = size
    scale = max(spec.height / height, spec.width / width)
    box_w, box_h = min(width, spec.width / scale), min(height, spec.height / scale)
    left, top = max(0.0, (width - box_w) / 2), max(0.0, (height - box_h) / 2)
    return left, top, min(width, left + box_w), min(height, top + box_h)


def _eight_bit(image: Any) -> Any:
    """``image`` with 8-bit samples: 16-bit grayscale (PNG) scaled down, the rest as it is.

    Pillow's ``convert`` clips 16-bit values to 255 rather than scaling them, so a 16-bit
    PNG would come out white.
    """
    from PIL import Image

    if image.mode not in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        return image
    wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
    return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8))


def _decode(data: memoryview | bytes, spec: ImageSpec) -> np.ndarray:
    """One image → ``[H, W, C]`` uint8; raises whatever Pillow raises for bad data."""
    from PIL import Image

    mode = "RGB" if spec.channels == 3 else "L"
    with Image.open(io.BytesIO(data)) as opened:
        if opened.format == "JPEG":
            opened.draft(mode, (spec.width, spec.height))  # DCT-domain downscale, still >= H×W
        image = _eight_bit(opened).convert(mode)
        width, height = image.size
        resample = getattr(Image.Resampling, spec.filter.upper())
        if spec.fit == "crop":
            out = image.resize(
                (spec.width, spec.height), resample, box=_centre_box(spec, image.size)
            )
            return np.asarray(out).reshape(spec.height, spec.width, spec.channels)
        scale = min(spec.height / height, spec.width / width)
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        inner = np.asarray(image.resize(size, resample)).reshape(size[1], size[0], spec.channels)
    canvas = np.full((spec.height, spec.width, spec.channels), spec.fill, np.uint8)
    top, left = (spec.height - size[1]) // 2, (spec.width - size[0]) // 2
    canvas[top : top + size[1], left : left + size[0]] = inner
    return canvas


def _decode_many(
    values: list[memoryview | None], spec: ImageSpec, out: np.ndarray, start: int
) -> list[tuple[int, str]]:
    """Decode ``values`` into ``out[start:]``; the (row, reason) of each that failed."""
    failures = []
    for i, value in enumerate(values):
        if value is None:
            failures.append((start + i, "it is null"))
            continue
        try:
            out[start + i] = _decode(value, spec)
        except Exception as exc:  # noqa: BLE001 - Pillow raises many kinds for bad data
            failures.append((start + i, _reason(exc)))
    return failures


def _reason(exc: Exception) -> str:
    """Why an image did not decode, without the in-memory object Pillow names.

    Pillow says "cannot identify image file <_io.BytesIO object at 0x7f…>": the
    address tells the reader nothing, the formats it does read do.
    """
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        return "not an image Pillow can read (JPEG, PNG, WebP, GIF, BMP, TIFF, …)"
    return f"{type(exc).__name__}: {_OBJECT_ADDRESS.sub('', str(exc)).strip()}"


_OBJECT_ADDRESS = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-f]+>")


class _Images:
    """The transform object: thread-safe, no per-shard state (see Transform)."""

    def __init__(self, spec: ImageSpec) -> None:
        self.spec = spec
        self.batch_rows = ROWS_PER_BATCH  # the pipeline slices input batches to this

    def _column(self, batch: pa.RecordBatch) -> tuple[str, pa.Array]:
        """The column the images replace, and the encoded images (a struct's field)."""
        if self.spec.column is not None:
            if self.spec.column in batch.schema.names:
                return self.spec.column, batch.column(self.spec.column)
            if (found := _struct_field(batch, self.spec.column)) is not None:
                return found
            raise MissingColumn(
                f"images: column {self.spec.column!r} is missing; the data has "
                f"{', '.join(batch.schema.names)}"
            )
        binary = [f.name for f in batch.schema if is_binary(f.type)]
        if len(binary) != 1:
            raise ParamMismatch(
                f"images: say which column holds the encoded images (column=NAME); binary "
                f"columns: {', '.join(binary) or 'none'}"
            )
        return binary[0], batch.column(binary[0])

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        spec, context = self.spec, shard_context()
        name, column = self._column(batch)
        if pa.types.is_struct(column.type):
            raise ParamMismatch(_struct_advice(name, column.type))
        if not is_binary(column.type):
            raise ParamMismatch(f"images: column {name!r} is {column.type}, not binary")
        if spec.output not in (None, name) and spec.output in batch.schema.names:
            raise ParamMismatch(
                f"images: output={spec.output!r} is already a column of the data; name the "
                f"pixels otherwise, or leave output out to replace {name!r}"
            )
        values = [None if v is None else memoryview(v) for v in column.to_pylist()]  # type: ignore[arg-type]
        out = np.empty((len(values), spec.height, spec.width, spec.channels), np.uint8)
        tasks = [
            (values[i : i + _PER_TASK], spec, out, i) for i in range(0, len(values), _PER_TASK)
        ]
        failures = sorted(f for part in context.map(_decode_many, tasks) for f in part)
        keys = batch.column("__key__") if "__key__" in batch.schema.names else None
        for row, why in failures:
            where = context.where(row, None if keys is None else keys[row].as_py())
            if not spec.skip:
                raise MalformedShard(
                    f"{where}: column {name!r} cannot be decoded as an image ({why}); pass "
                    "--param on_error=skip to drop such samples"
                )
            context.skip(f"{where}: {why}")
        keep = np.ones(len(values), bool)
        keep[[row for row, _ in failures]] = False
        pixels = pa.array((out[keep] if failures else out).reshape(-1))
        for size in (spec.channels, spec.width, spec.height):
            pixels = pa.FixedSizeListArray.from_arrays(pixels, size)
        if failures:
            batch = batch.filter(pa.array(keep))
        index = batch.schema.get_field_index(name)
        batch = batch.remove_column(index)
        return batch.add_column(index, spec.output or name, pixels)


def _struct_field(batch: pa.RecordBatch, path: str) -> tuple[str, pa.Array] | None:
    """``image.bytes``: the top-level column and the values of its field; None if no such.

    The longest top-level name the path starts with is taken (a column may have a
    ``.`` in its name). A row whose struct is null has a null field (it then fails,
    or is skipped, as any null image). A field the struct lacks is refused, naming
    the fields it has.
    """
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        top = ".".join(parts[:cut])
        if top not in batch.schema.names:
            continue
        values: pa.Array = batch.column(top)
        for depth, field in enumerate(parts[cut:]):
            kind = values.type
            if not pa.types.is_struct(kind) or kind.get_field_index(field) < 0:
                inside = ".".join(parts[: cut + depth])
                names = (
                    [kind.field(i).name for i in range(kind.num_fields)]
                    if pa.types.is_struct(kind)
                    else []
                )
                has = (
                    f"its fields are {', '.join(names)}" if names else f"it is {kind}, not a struct"
                )
                raise MissingColumn(f"images: column {path!r} is missing: {inside!r} has no "
                                    f"field {field!r} ({has})")  # fmt: skip
            values = pc.struct_field(values, [field])
        return top, values
    return None


def _struct_advice(name: str, kind: pa.StructType) -> str:
    """Which ``column=`` names a struct column's encoded images (Hugging Face ``Image()``)."""
    fields = [kind.field(i) for i in range(kind.num_fields)]
    binary = [f.name for f in fields if is_binary(f.type)]
    if not binary:
        return f"images: column {name!r} is {kind}, a struct with no binary field, not images"
    hf = " (Hugging Face's Image() keeps the encoded file in 'bytes')" if "bytes" in binary else ""
    return (
        f"images: column {name!r} is {kind}, not binary; name the field that holds the "
        f"encoded images: {' or '.join(f'column={name}.{b}' for b in binary)}{hf}"
    )


def images_transform(params: Mapping[str, str]) -> _Images:
    """The ``images`` transform for ``params`` (see the module docstring)."""
    return _Images(ImageSpec.parse(params))
