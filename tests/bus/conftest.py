"""Fixtures of the bus tests (helpers live in bus_testkit.py)."""

from __future__ import annotations

import pytest
import zmq

from common.wire.link import KeyLayout, init_keys


@pytest.fixture
def keys(tmp_path) -> KeyLayout:
    """Keys for two ground stations and the payload, all authorized by the bus."""
    return init_keys(tmp_path / "keys", clients=("ground", "station2", "payload"))


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def bus_processes():
    """Start `ow bus run` processes with `bus_processes(config)`; any still running at the end of
    the test (a failed assertion) is killed, payload included."""
    from hil.bus import BusProcess

    started: list[BusProcess] = []

    def start(config) -> BusProcess:
        process = BusProcess(config)
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.kill()
