"""Shared fixtures of the wire tests. A test that takes a `sample` argument runs once per
message type."""

from __future__ import annotations

import pytest
from wire_samples import sample_messages

from common.wire import messages as m


def pytest_generate_tests(metafunc):
    if "sample" in metafunc.fixturenames:
        samples = sample_messages()
        metafunc.parametrize("sample", samples, ids=[s.TYPE.name for s in samples])


@pytest.fixture
def all_samples() -> list[m.Message]:
    return sample_messages()
