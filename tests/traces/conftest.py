"""Shared fixtures for the trace tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from trace_testkit import EXAMPLE_LINES, write_lines  # noqa: F401


@pytest.fixture
def example_lines() -> list[str]:
    return list(EXAMPLE_LINES)


@pytest.fixture
def example_path(tmp_path: Path) -> Path:
    return write_lines(tmp_path / "example.jsonl", EXAMPLE_LINES)
