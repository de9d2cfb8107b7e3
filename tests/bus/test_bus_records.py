"""What the bus keeps on disk: the store-and-forward queue (durable, torn tails cut off,
compacted) and the run log (reader API, torn lines, event sequences for replays)."""

from __future__ import annotations

import json

import pytest

from common.wire import Apid, NodeId, encode
from common.wire import messages as m
from hil.bus import buslog as bl
from hil.bus.busstore import STORE_FILE, CommandStore


def ping(seq: int, key: int = 0) -> bytes:
    return encode(m.Ping(key=key), Apid.PAYLOAD, seq, source_id=NodeId.GROUND)


def test_store_keeps_live_commands_in_order_across_reopen(tmp_path):
    store = CommandStore(tmp_path)
    entries = [store.enqueue(ping(seq), "ground", 1.0) for seq in range(5)]
    store.flush()
    store.mark_forwarded(entries[0], link=1)
    store.mark_forwarded(entries[1], link=1)
    store.confirm(entries[0], "accepted")
    store.flush()
    store.enqueue(ping(9), "ground", 2.0)  # durable when enqueue returns
    store.mark_forwarded(entries[2], link=1)  # recorded but never flushed: not durable

    again = CommandStore(tmp_path)
    assert [e.request.seq for e in again.pending()] == [1, 2, 3, 4, 9]
    assert [e.forwards for e in again.pending()] == [1, 0, 0, 0, 0], "a restarted bus knows what may have been sent"
    assert again.find(entries[1].key).store_id == entries[1].store_id
    assert again.find(entries[0].key) is None
    # Ids keep growing after the compaction on open: log lines of earlier runs stay unambiguous.
    assert again.enqueue(ping(10), "ground", 3.0).store_id > entries[-1].store_id


def test_store_cuts_a_torn_tail_and_keeps_what_came_before(tmp_path):
    store = CommandStore(tmp_path)
    for seq in range(3):
        store.enqueue(ping(seq), "ground", 1.0)
    store.flush()
    path = tmp_path / STORE_FILE
    good = path.read_bytes()
    torn = good + good[-40:-10]  # half a record, as a bus killed mid-append leaves it
    path.write_bytes(torn)
    again = CommandStore(tmp_path)
    assert again.dropped_tail_bytes == 30
    assert [e.request.seq for e in again.pending()] == [0, 1, 2]
    again.enqueue(ping(3), "ground", 1.0)
    again.flush()
    assert [e.request.seq for e in CommandStore(tmp_path).pending()] == [0, 1, 2, 3]


def test_store_compacts_confirmed_entries_away(tmp_path):
    store = CommandStore(tmp_path)
    entries = [store.enqueue(ping(seq, key=seq), "ground", 1.0) for seq in range(50)]
    store.flush()
    for entry in entries[:-1]:
        store.confirm(entry, "accepted")
    store.flush()
    before = (tmp_path / STORE_FILE).stat().st_size
    again = CommandStore(tmp_path)
    after = (tmp_path / STORE_FILE).stat().st_size
    assert after < before / 10
    assert [e.request.seq for e in again.pending()] == [49]


def test_run_log_round_trip_and_torn_lines(tmp_path):
    path = tmp_path / bl.LOG_FILE
    log = bl.BusLog(path, run_id="run-1")
    log.write(bl.RUN_START, trace_s=0.0, clock_s=0.0, trace="t", time_scale=0.1)
    log.write(bl.POWER_ON, trace_s=0.0, clock_s=0.0, cause="restored", pid=10)
    log.write(
        bl.COMMAND_RECEIVED,
        trace_s=1.5,
        clock_s=0.15,
        type="PING",
        task_id=None,
        request={"apid": 32, "source": 1, "seq": 7, "type": "PING"},
    )
    log.write(bl.WARNING, trace_s=3.0, clock_s=0.3, cause="thermal", lead_trace_s=2.0)
    log.write(bl.POWER_OFF, trace_s=5.0, clock_s=0.5, cause="thermal", pid=10)
    log.close()
    with open(path, "a") as f:
        f.write('{"run":"run-1","n":6,"kind":"power_on","ut')  # the bus was killed mid-line
    second = bl.BusLog(path, run_id="run-2")
    second.write(bl.RUN_START, trace_s=0.0, clock_s=0.0)
    second.close()

    entries = bl.read_log(path)
    assert [(e.run, e.kind) for e in entries] == [
        ("run-1", "run_start"),
        ("run-1", "power_on"),
        ("run-1", "command_received"),
        ("run-1", "warning"),
        ("run-1", "power_off"),
        ("run-2", "run_start"),
    ]
    assert entries[2]["request"]["seq"] == 7 and entries[2].trace_s == 1.5 and entries[2].clock_s == 0.15
    assert list(bl.runs(entries)) == ["run-1", "run-2"]
    assert [e.kind for e in bl.power_timeline(entries)] == ["power_on", "warning", "power_off"]
    assert bl.event_sequence(entries, kinds=[bl.POWER_ON, bl.POWER_OFF, bl.WARNING, bl.COMMAND_RECEIVED]) == [
        ("power_on", "restored"),
        ("command_received", "PING", None, (32, 1, 7, "PING")),
        ("warning", "thermal", 2.0),
        ("power_off", "thermal"),
    ]

    with open(path, "a") as f:
        f.write("not json\n")
        f.write(json.dumps({"run": "run-3", "n": 1, "kind": "run_stop", "utc": 0, "wall_s": 0}) + "\n")
    with pytest.raises(ValueError, match="not a JSON object"):
        bl.read_log(path)


def test_run_log_refuses_unknown_kinds_and_reserved_fields(tmp_path):
    log = bl.BusLog(tmp_path / bl.LOG_FILE)
    with pytest.raises(ValueError):
        log.write("power_flicker")
    with pytest.raises(ValueError):
        log.write(bl.POWER_ON, run="other")
    log.close()


def test_run_log_rotates_and_is_read_whole_in_order(tmp_path):
    """Finding 6: the run log is bounded by rotation; read_log and LogFollower read across it."""
    path = tmp_path / bl.LOG_FILE
    log = bl.BusLog(path, run_id="run-1", segment_bytes=4096, segments=3)
    follower = bl.LogFollower(path)
    followed = b""
    for i in range(60):
        log.write(bl.COMMAND_REJECTED, trace_s=float(i), code="RATE_LIMITED", reason="x" * 100)
        if i % 7 == 0:
            followed += follower.read()
    followed += follower.read()
    log.close()
    kept = [bl.segment_path(path, i) for i in range(3)]
    assert all(p.exists() for p in kept) and not bl.segment_path(path, 3).exists()
    assert all(p.stat().st_size < 4096 + 300 for p in kept)
    entries = bl.read_log(path)
    numbers = [e.n for e in entries]
    assert numbers == list(range(numbers[0], 61)) and numbers[0] > 1, "the oldest segments went, in order"
    assert [json.loads(line)["n"] for line in followed.splitlines()] == list(range(1, 61)), "followed whole"


def test_run_log_keeps_lines_in_memory_while_the_disk_refuses_them(tmp_path, monkeypatch):
    """Finding 5: lines a read-only disk refuses are written, in order, once it takes them again."""
    from common import durable

    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"mode": "ok"}))
    monkeypatch.setattr(durable, "storage_faults", durable.StorageFaults(str(control)))
    seen = []

    class Listener:
        def failed(self, writer, exc):
            seen.append(("failed", writer))

        def succeeded(self, writer):
            seen.append(("ok", writer))

    path = tmp_path / "bus" / bl.LOG_FILE
    log = bl.BusLog(path, run_id="run-1", listener=Listener())
    log.write(bl.RUN_START, trace_s=0.0)
    control.write_text(json.dumps({"mode": "read_only", "under": [str(tmp_path / "bus")]}) + " ")
    for i in range(5):
        log.write(bl.POWER_ON, trace_s=float(i))
    assert log.held_lines == 5 and not log.retry()
    assert [e.n for e in bl.read_log(path)] == [1]
    control.write_text(json.dumps({"mode": "ok"}))
    assert log.retry() and log.held_lines == 0
    log.write(bl.RUN_STOP)
    log.close()
    assert [e.n for e in bl.read_log(path)] == [1, 2, 3, 4, 5, 6, 7]
    assert seen == [("failed", "run log"), ("ok", "run log")]
