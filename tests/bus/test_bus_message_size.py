"""The bus's server sockets against an authorized client that sends too much (finding 10: a
200 MiB message raised the bus's memory by 350 MB before it was rejected) or too fast (a flood
past the receive queue, with ZMTP heartbeats on, made libzmq drop the connection or abort)."""

from __future__ import annotations

import os

import pytest
import zmq
from bus_testkit import HANG_S, bus_config, ground_station, wait_for, window, write_trace

from common.wire import Apid, SequenceCounter
from common.wire import messages as m
from common.wire.link import monitor_socket
from hil.bus import buslog as bl

pytestmark = pytest.mark.slow


def _peak_rss(pid: int, reset: bool = False) -> int:
    """The process's peak RSS (VmHWM), after resetting it to the current RSS if `reset`."""
    if reset:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _received(log_path) -> list:
    return [e for e in bl.read_log(log_path) if e.kind == bl.COMMAND_RECEIVED]


def test_oversized_messages_and_floods_do_not_reach_the_bus(tmp_path, keys, context, bus_processes):
    # The payload stays off (its window opens at t = 900 s): commands are stored, nothing else.
    trace = write_trace(tmp_path / "late.jsonl", 1000, [window(900, 1000, None)], telemetry=False)
    # No rate limit or quota here: the flood must reach the bus's application (they are
    # tests/bus/test_bus_stations.py's subject).
    config = bus_config(
        tmp_path, keys, trace, tmp_path / "record.jsonl", time_scale=1.0, station_rate=0.0, station_quota=5000
    )
    bus = bus_processes(config)
    log = tmp_path / "bus" / bl.LOG_FILE
    ground = ground_station(context, keys, bus.endpoints.commands)
    ground.send(m.Ping(key=1))
    wait_for(lambda: len(_received(log)) == 1, HANG_S, what="first command stored")
    before = _peak_rss(bus.proc.pid, reset=True)
    monitor = monitor_socket(ground.sock, zmq.EVENT_DISCONNECTED)
    big = os.urandom(200 << 20)
    ground.sock.send(big, copy=False)  # an authorized client, a 200 MiB message
    del big

    def dealt_with():  # the bus dropped the connection at once, or took the message and rejected it
        if monitor.poll(100):
            return True
        return any(e.kind == bl.COMMAND_REJECTED for e in bl.read_log(log))

    wait_for(dealt_with, HANG_S, what="the bus to deal with the 200 MiB message")
    ground.sock.disable_monitor()
    monitor.close(linger=0)
    ground.sock.close(linger=0)
    ground = ground_station(context, keys, bus.endpoints.commands)
    ground.counter = SequenceCounter({int(Apid.PAYLOAD): 1})  # the station goes on counting
    ground.send(m.Ping(key=2))
    wait_for(lambda: len(_received(log)) == 2, HANG_S, what="the bus still taking commands")
    grown = _peak_rss(bus.proc.pid) - before
    assert grown < 64 << 20, f"bus peak RSS grew by {grown >> 20} MiB"
    for key in range(3, 1202):  # a flood past the receive queue (1000 messages by default)
        ground.send(m.Ping(key=key))
    wait_for(lambda: len(_received(log)) >= 1201, HANG_S, interval_s=0.5, what="the flood stored")
    assert bus.proc.poll() is None
    stored = {e.data["request"]["seq"] for e in _received(log)}
    assert len(stored) == 1201  # every command of the flood arrived and was stored once
