"""Everything that talks to edge nodes: EdgeDataset, node selection, the ops CLI.

``EdgeDataset`` needs torch (``pip install 'edgecache[torch]'``); it is imported
lazily so edge-only installs can use the rest of this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edgecache.clients.dataset import EdgeDataset

__all__ = ["EdgeDataset"]


def __getattr__(name: str) -> Any:
    if name == "EdgeDataset":
        try:
            from edgecache.clients.dataset import EdgeDataset
        except ImportError as exc:
            raise ImportError(
                f"EdgeDataset needs torch ({exc}); install it with pip install 'edgecache[torch]'"
            ) from exc
        return EdgeDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
