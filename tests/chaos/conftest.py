"""Fixtures for chaos tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest


@pytest.fixture
def figure(request: pytest.FixtureRequest) -> Callable[[str, object], None]:
    """Print a figure line; `make chaos` (pytest -s) shows them for docs/reliability.md."""

    def report(name: str, value: object) -> None:
        print(f"\nFIGURE {request.node.name}: {name} = {value}")

    return report
