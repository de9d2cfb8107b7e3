"""Fixtures of the ground tests: real CURVE keys in a temporary directory, the scripted test
peer (tests/ground/ground_test_peer.py) on ephemeral loopback ports, sample pictures, and `ow` run
in-process with only the ground component registered (so the tests exercise the real
`common.cli.main` error handling without depending on other components)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import structlog
from ground_test_peer import ScriptedBusPayloadPeer
from ground_testkit import write_picture

from common.wire.link import KeyLayout, init_keys


@dataclasses.dataclass
class Outcome:
    code: int | str | None  # what main() returned, or a SystemExit's code
    out: str
    err: str


@pytest.fixture(autouse=True)
def _reset_logging():
    # `ow ground` points structlog at the (captured) stderr of the test; do not leak that config.
    yield
    structlog.reset_defaults()


@pytest.fixture
def keys(tmp_path) -> KeyLayout:
    return init_keys(tmp_path / "keys")


@pytest.fixture
def peer(keys):
    with ScriptedBusPayloadPeer(keys) as p:
        yield p


@pytest.fixture
def pictures(tmp_path) -> list[Path]:
    return [
        write_picture(tmp_path / "coast.png", seed=1),
        write_picture(tmp_path / "harbour view.png", seed=2, size=(64, 64)),
    ]


@pytest.fixture
def ow(monkeypatch, capsys):
    """Run `ow ARGS...` in-process; returns Outcome(code, stdout, stderr)."""
    import common.cli

    monkeypatch.setattr(common.cli, "COMPONENTS", [("ground.cli", "ow ground")])

    def run(*args) -> Outcome:
        capsys.readouterr()
        code: int | str | None
        try:
            code = common.cli.main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
        captured = capsys.readouterr()
        return Outcome(code, captured.out, captured.err)

    return run
