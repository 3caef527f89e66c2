"""Transforms: built-in ones, and the registry that finds the rest.

A version's preprocessing spec names a transform: built-in (``identity``,
``columns``, ``images`` in :mod:`.images`, ``tokens`` in :mod:`.text`),
registered in this process, or installed as a Python entry point in group
``edgecache.transforms``. The same raw data with a different transform is a
different version.

A transform maps one record batch to another. One that must see a whole
shard in order (packing tokens into rows carries tokens from batch to batch)
also has ``stream(batches) -> batches``, which the pipeline then uses. One
whose output is large per input row may set ``batch_rows`` and gets input
batches of at most that many rows. Some need files from origin besides the
shard (a tokenizer): :func:`resource_refs` names them, the caller fetches
them, and :func:`load_transform` hands their bytes over.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import pyarrow as pa

from edgecache.cache.errors import MalformedShard, UnknownTransform
from edgecache.cache.preprocess.arrow_types import (
    check_param_names,
    param_names,
    param_pairs,
    parse_type,
)
from edgecache.cache.preprocess.casts import lossless_cast
from edgecache.cache.preprocess.fixes import MissingColumn
from edgecache.cache.preprocess.formats import ARROW_ERRORS

__all__ = [
    "ENTRY_POINT_GROUP",
    "MissingColumn",
    "Transform",
    "TransformFactory",
    "canonical_params",
    "cast_column",
    "column_index",
    "is_builtin",
    "keeps_rows",
    "load_transform",
    "register_transform",
    "resource_refs",
    "unregister_transform",
]

ENTRY_POINT_GROUP = "edgecache.transforms"


class Transform(Protocol):
    """Turns one record batch into another; must be thread-safe and keep no per-shard state."""

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Return the transformed batch; raise MalformedShard for data it cannot handle."""
        ...


TransformFactory = Callable[[dict[str, str]], Transform]
_registered: dict[str, TransformFactory] = {}


def _pairs(key: str, value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for old, new, eq in param_pairs(value):
        if not eq or not old or not new or old in out:
            raise ValueError(
                f"columns param {key}={value!r}: expected unique 'name=value' pairs (a name "
                'holding , = or a quote in double quotes: "a,b"=c)'
            )
        out[old] = new
    return out


def cast_column(batch: pa.RecordBatch, index: int, target: pa.DataType) -> pa.Array:
    """Column ``index`` cast to ``target`` keeping every value (see :mod:`.casts`).

    Raises:
        MalformedShard: the cast fails or would change a value; the message names the
            column and shows values that would change.
    """
    column, name = batch.column(index), batch.schema.field(index).name
    if column.type == target:
        return column
    try:
        return lossless_cast(column, target)
    except ARROW_ERRORS as exc:
        raise MalformedShard(
            f"column {name!r} cannot be cast from {column.type} to {target}: {exc}"
        ) from exc


def column_index(batch: pa.RecordBatch, name: str, why: str) -> int:
    """The position of column ``name``; MissingColumn (saying ``why``) if missing or twice."""
    names = batch.schema.names
    if names.count(name) != 1:
        found = "appears more than once" if name in names else "is missing"
        raise MissingColumn(f"column {name!r} ({why}) {found}; the data has: {', '.join(names)}")
    return names.index(name)


def _columns(params: dict[str, str]) -> Transform:
    check_param_names("columns", params, ("select", "rename", "cast"))
    select = param_names(params.get("select", ""))
    if len(set(select)) != len(select):
        raise ValueError(f"columns param select={params['select']!r} names a column twice")
    rename = _pairs("rename", params.get("rename", ""))
    cast = {k: parse_type(v) for k, v in _pairs("cast", params.get("cast", "")).items()}

    def columns(batch: pa.RecordBatch) -> pa.RecordBatch:
        if select:
            batch = batch.select([column_index(batch, n, "in select") for n in select])
        if rename:
            for old in rename:
                column_index(batch, old, "in rename")
            batch = batch.rename_columns([rename.get(n, n) for n in batch.schema.names])
        if cast:
            arrays = list(batch.columns)
            for name, target in cast.items():
                i = column_index(batch, name, "in cast")
                try:
                    arrays[i] = cast_column(batch, i, target)
                except MalformedShard as exc:
                    raise MalformedShard(
                        f"{exc}; cast {name!r} to a type that holds its values, or leave it "
                        "out of cast"
                    ) from exc
            batch = pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)
        return batch

    return columns


def _identity(params: dict[str, str]) -> Transform:
    if params:
        raise ValueError(
            f"identity transform takes no params, got {sorted(params)}: drop --param, or "
            "name the transform they are for with --transform (columns, images, tokens; "
            "docs/preprocessing.md)"
        )
    return lambda batch: batch


def _images(params: dict[str, str]) -> Transform:
    try:
        import PIL  # noqa: F401 - an optional extra: say how to install it
    except ImportError as exc:
        raise ValueError(
            "the images transform needs Pillow: pip install 'edgecache[images]'"
        ) from exc
    from edgecache.cache.preprocess.images import images_transform

    return images_transform(params)


def _tokens(params: dict[str, str]) -> Transform:
    raise ValueError("the tokens transform needs its tokenizer file: pass resources")


_BUILTINS: Mapping[str, TransformFactory] = MappingProxyType(
    {"identity": _identity, "columns": _columns, "images": _images, "tokens": _tokens}
)
# Params naming files in origin that a built-in needs besides the shard.
_RESOURCE_PARAMS: Mapping[str, tuple[str, ...]] = MappingProxyType({"tokens": ("tokenizer",)})


def resource_refs(name: str, params: Mapping[str, str]) -> list[str]:
    """The origin files (keys under the source prefix, or URLs) transform ``name`` needs."""
    return [params[p] for p in _RESOURCE_PARAMS.get(name, ()) if params.get(p)]


def keeps_rows(name: str, params: Mapping[str, str]) -> bool:
    """Whether transform ``name`` keeps every row: then a row count can come from metadata.

    ``identity`` and ``columns`` do; ``images`` unless it skips corrupt images;
    ``tokens`` and every plugin may not (publish then runs them in full).
    """
    name = name or "identity"
    if name == "images":
        return params.get("on_error", "fail").strip().lower() != "skip"
    return name in ("identity", "columns")


def canonical_params(
    name: str, params: Mapping[str, str], resources: Mapping[str, bytes]
) -> dict[str, str]:
    """``params`` as publish records them: pinned to what makes the output the same everywhere.

    ``images`` records the decoder (``decoder=pillow-X.Y.Z``), ``tokens`` the
    tokenizer file's SHA-256; a node then refuses to produce other bytes.
    """
    out = {str(k): str(v) for k, v in params.items()}
    if empty := sorted(k for k, v in out.items() if not v.strip()):
        # Left empty, a param would mean its default on every node (select= keeps every
        # column): the command line said something it did not get.
        raise ValueError(
            f"{name} transform: {', '.join(f'{k}=' for k in empty)} "
            f"{'has' if len(empty) == 1 else 'have'} no value; give one, or leave the param "
            "out for its default"
        )
    if name == "images" and "decoder" not in out:
        load_transform(name, out)  # fails first if Pillow is missing or the params are bad
        from edgecache.cache.preprocess.images import decoder_version

        out["decoder"] = decoder_version()
    if name == "tokens" and out.get("tokenizer") in resources:
        from edgecache.cache.preprocess.text import sha256_hex

        digest = sha256_hex(resources[out["tokenizer"]])
        if out.setdefault("tokenizer_sha256", digest) != digest:
            raise ValueError(
                f"tokenizer_sha256={out['tokenizer_sha256']} but {out['tokenizer']} has SHA-256 "
                f"{digest}; leave tokenizer_sha256 out and publish records it"
            )
    return out


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def is_builtin(name: str) -> bool:
    """Whether ``name`` is a built-in transform (built-ins never add or drop rows)."""
    return (name or "identity") in _BUILTINS


def register_transform(name: str, factory: TransformFactory, *, overwrite: bool = False) -> None:
    """Register ``factory(params) -> Transform`` under ``name`` for this process.

    An in-process registration shadows an installed entry point of the same name.

    Raises:
        ValueError: the name is empty or built-in, or already registered and not ``overwrite``.
        TypeError: ``factory`` is not callable.
    """
    if not name or name in _BUILTINS:
        raise ValueError(f"cannot register transform {name!r}: empty or a built-in name")
    if not callable(factory):
        raise TypeError(f"transform factory for {name!r} must be callable, got {factory!r}")
    if not overwrite and (name in _registered or name in _entry_points()):
        raise ValueError(
            f"transform {name!r} is already registered; pass overwrite=True to replace"
        )
    _registered[name] = factory


def unregister_transform(name: str) -> None:
    """Remove an in-process registration.

    Raises:
        KeyError: ``name`` was not registered with :func:`register_transform`.
    """
    if _registered.pop(name, None) is None:
        raise KeyError(f"transform {name!r} was not registered in this process")


def load_transform(
    name: str, params: Mapping[str, str], resources: Mapping[str, bytes] | None = None
) -> Transform:
    """Build the transform ``name`` with ``params``: built-in, registered, then entry point.

    Built-ins: ``identity`` (no params); ``columns`` (``select="a,b"``,
    ``rename="a=x,b=y"`` applied after select, ``cast="x=int32,y=list<float>"``
    on the renamed columns); ``images`` and ``tokens`` (see their modules).
    ``resources`` maps each of :func:`resource_refs` to the file's bytes.

    Raises:
        UnknownTransform: no transform has that name, or its entry point fails to load.
        ValueError: the params are not what the transform accepts, or a resource is missing.
    """
    plain = {str(k): str(v) for k, v in params.items()}
    if name == "tokens":
        from edgecache.cache.preprocess.text import tokens_transform

        return tokens_transform(plain, resources or {})
    factory = _BUILTINS.get(name) or _registered.get(name)
    if factory is None:
        installed = _entry_points()
        if name not in installed:
            known = sorted({*_BUILTINS, *_registered, *installed})
            raise UnknownTransform(
                f"no transform named {name!r}; available: {', '.join(known)}. To add one, install "
                f'a package declaring [project.entry-points."{ENTRY_POINT_GROUP}"] '
                f'{name or "name"} = "module:factory", where factory(params) returns a callable '
                "RecordBatch -> RecordBatch"
            )
        try:
            factory = installed[name].load()
        except Exception as exc:
            raise UnknownTransform(
                f"transform {name!r} is installed as {installed[name].value!r} but fails to "
                f"load ({type(exc).__name__}: {exc}); fix or reinstall that package"
            ) from exc
    transform = factory(plain)
    if not callable(transform):
        raise TypeError(f"transform factory {name!r} returned {transform!r}, which is not callable")
    return transform
