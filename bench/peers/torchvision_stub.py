"""A stand-in for torchvision, used only while importing MosaicML Streaming.

Why it exists: ``import streaming`` imports ``streaming.vision``, whose
dataset classes subclass ``torchvision.datasets.VisionDataset``. PyPI has
only CUDA builds of torchvision, and those do not import beside the CPU
build ``torch==2.13.0+cpu`` this project uses (``RuntimeError: operator
torchvision::nms does not exist``), so torchvision is not installed at all
(see bench/requirements.txt). This benchmark never touches
``streaming.vision`` (it uses ``MDSWriter`` and ``StreamingDataset``), so
:func:`import_streaming` puts four empty placeholder modules under
``torchvision`` in ``sys.modules`` for the duration of ``import streaming``
and removes them afterwards: nothing else in the process ever sees them.

transformers (a declared dependency of streaming, imported by its
``StreamingDataLoader``) is the real package; it is imported first, while no
placeholder exists, so it correctly records that torchvision is absent.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

__all__ = ["import_streaming"]

_NAMES = (
    "torchvision",
    "torchvision.datasets",
    "torchvision.transforms",
    "torchvision.transforms.functional",
)


class _Unavailable:
    """Placeholder for torchvision classes and functions: unusable by design."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "torchvision is stubbed in bench.peers (its PyPI builds need CUDA torch); "
            "streaming.vision cannot be used in this benchmark"
        )


def _placeholders() -> dict[str, types.ModuleType]:
    modules = {
        name: types.ModuleType(name, "bench.peers.torchvision_stub placeholder") for name in _NAMES
    }
    for name in ("torchvision", "torchvision.transforms"):
        modules[name].__path__ = []  # a package, so its submodules resolve
    modules["torchvision.datasets"].VisionDataset = type("VisionDataset", (_Unavailable,), {})  # type: ignore[attr-defined]
    modules["torchvision.datasets"].CIFAR10 = type("CIFAR10", (_Unavailable,), {})  # type: ignore[attr-defined]
    modules["torchvision.transforms.functional"].to_tensor = _Unavailable  # type: ignore[attr-defined]
    return modules


def import_streaming() -> Any:
    """``import streaming`` (MosaicML Streaming) without torchvision installed."""
    if "streaming" in sys.modules:
        return sys.modules["streaming"]
    # Real transformers first, so that it sees no torchvision (it probes with find_spec).
    import transformers.feature_extraction_utils  # noqa: F401
    import transformers.tokenization_utils_base  # noqa: F401

    if importlib.util.find_spec("torchvision") is not None:  # installed for real: use it
        import streaming

        return streaming
    sys.modules.update(_placeholders())
    try:
        import streaming
    finally:
        for name in _NAMES:
            sys.modules.pop(name, None)
    return streaming
