"""The bus's own disk (finding 5: ENOSPC from its command store killed the bus, payload and all):
a command the bus cannot store durably is refused BUS_STORAGE_FULL and not relayed; what it
stored before goes on being relayed, its marks, run log and telemetry numbering kept in memory;
BUS_STORAGE_FULL / BUS_STORAGE_RESTORED once per spell; writing resumes by itself."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess

import pytest
from bus_testkit import (
    HANG_S,
    bus_config,
    ground_station,
    read_record,
    telemetry_subscriber,
    wait_for,
    window,
    write_trace,
)

from common import durable
from common.wire import Apid, EventId, ResponseCode, decode
from common.wire import messages as m
from common.wire.link import recv_packet
from hil.bus import BusThread
from hil.bus import buslog as bl
from hil.bus.busstore import CommandStore
from hil.bus.storage import StorageWatch, TolerantSequenceCounter


def set_faults(control, **spec) -> None:
    tmp = control.with_name(control.name + ".tmp")
    tmp.write_text(json.dumps(spec))
    os.replace(tmp, control)


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """Storage fault injection for every DurableFS (and the run log) of this process."""
    control = tmp_path / "faults.json"
    set_faults(control, mode="ok")
    monkeypatch.setattr(durable, "storage_faults", durable.StorageFaults(str(control)))
    return control


def refusal(station, seq, timeout_s=HANG_S) -> m.Rejected:
    station.wait(lambda inbox: any(isinstance(x[1], m.Rejected) and x[1].tc_seq == seq for x in inbox), timeout_s)
    return next(x[1] for x in station.inbox if isinstance(x[1], m.Rejected) and x[1].tc_seq == seq)


def pong(station, key, timeout_s=HANG_S) -> None:
    station.wait(lambda inbox: any(isinstance(x[1], m.Pong) and x[1].key == key for x in inbox), timeout_s)


def bus_events(sub) -> list[EventId]:
    out = []
    while (received := recv_packet(sub, timeout_s=0)) is not None:
        header, message = decode(received.packet)
        if isinstance(message, m.Event) and header.apid == Apid.BUS:
            out.append(message.event_id)
    return out


def executed(record) -> list[int]:
    return [r["seq"] for r in read_record(record) if r["ev"] == "accepted"]


def test_the_bus_survives_its_full_then_read_only_disk(tmp_path, keys, context, faults):
    # The payload is off for the first 5 s (wall): commands wait in the store meanwhile.
    trace = write_trace(tmp_path / "late.jsonl", 1000, [window(50, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    bus_dir = tmp_path / "bus"
    with BusThread(bus_config(tmp_path, keys, trace, record)) as bus:
        sub = telemetry_subscriber(context, keys, bus.endpoints.telemetry)
        ground = ground_station(context, keys, bus.endpoints.commands)
        stored = [ground.send(m.Ping(key=k))[1] for k in (1, 2, 3)]
        wait_for(lambda: len(bus.bus.store) == 3, HANG_S, what="three commands stored")

        set_faults(faults, mode="full", free_bytes=0, under=[str(bus_dir)])
        _, refused_full = ground.send(m.Ping(key=4))
        report = refusal(ground, refused_full)
        assert report.code == ResponseCode.BUS_STORAGE_FULL and "full" in report.reason
        # Power comes per the trace; what was stored goes out though no mark can be written.
        for key in (1, 2, 3):
            pong(ground, key)
        assert bus.bus.store.has_pending, "forwarding marks and confirmations wait in memory"
        assert bus.bus.buslog.held_lines > 0, "run-log lines wait in memory"

        set_faults(faults, mode="read_only", under=[str(bus_dir)])
        _, refused_ro = ground.send(m.Ping(key=5))
        report = refusal(ground, refused_ro)
        assert report.code == ResponseCode.BUS_STORAGE_FULL and "read-only" in report.reason

        set_faults(faults, mode="ok")
        wait_for(lambda: bus.bus.storage.ok and not bus.bus.store.has_pending, HANG_S, what="storage restored")
        _, after = ground.send(m.Ping(key=6))
        pong(ground, 6)
        events = bus_events(sub)
    # One event per transition: full -> read-only is the same spell.
    assert events.count(EventId.BUS_STORAGE_FULL) == 1 and events.count(EventId.BUS_STORAGE_RESTORED) == 1
    assert executed(record) == [*stored, after], "each stored command once; the refused ones never"
    assert len(CommandStore(bus_dir / "bus-store")) == 0, "every confirmation reached the disk in the end"
    log = bl.read_log(bus_dir / bl.LOG_FILE)
    kinds = [(e.kind, e.get("event")) for e in log]
    full_at = kinds.index((bl.BUS_EVENT, "BUS_STORAGE_FULL"))
    restored_at = kinds.index((bl.BUS_EVENT, "BUS_STORAGE_RESTORED"))
    forwarded = [i for i, e in enumerate(log) if e.kind == bl.COMMAND_FORWARDED]
    assert all(full_at < i < restored_at for i in forwarded[:3]), "logged in memory during the spell, kept"
    assert [e.kind for e in log].count(bl.POWER_ON) == 1


def test_telemetry_numbers_go_on_while_their_reservation_cannot_be_written(tmp_path, faults):
    changes = []
    watch = StorageWatch(lambda failing, detail: changes.append(failing))
    counter = TolerantSequenceCounter(tmp_path / "seq.bin", watch, reserve=4)
    first = [counter.next(Apid.BUS) for _ in range(3)]
    set_faults(faults, mode="read_only")
    more = [counter.next(Apid.BUS) for _ in range(10)]
    assert first + more == list(range(13)) and changes == [True]
    set_faults(faults, mode="ok")
    counter._retry_at = 0.0  # the next reservation is tried at once instead of a second later
    counter.next(Apid.BUS)
    assert changes == [True, False]


@contextlib.contextmanager
def small_tmpfs(path, size="1m"):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path) -> None:
    """Write until the file system says ENOSPC."""
    with open(path / "filler", "wb", buffering=0) as f:
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_the_bus_on_a_real_read_only_then_full_tmpfs(tmp_path, keys, context):
    trace = write_trace(tmp_path / "on.jsonl", 1000, [window(0, 1000, None)], telemetry=False)
    record = tmp_path / "payload.jsonl"
    with small_tmpfs(tmp_path / "busdisk") as disk:
        (disk / "bus").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        config = bus_config(tmp_path, keys, trace, record, data_dir=disk / "bus")
        with BusThread(config) as bus:  # starts on a read-only disk
            wait_for(lambda: bus.bus.payload_rid is not None, HANG_S, what="payload connected")
            ground = ground_station(context, keys, bus.endpoints.commands)
            _, refused_ro = ground.send(m.Ping(key=1))
            report = refusal(ground, refused_ro)
            assert report.code == ResponseCode.BUS_STORAGE_FULL and "read-only" in report.reason
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
            wait_for(lambda: bus.bus.storage.ok, HANG_S, what="the disk writable again")
            ground.send(m.Ping(key=2))
            pong(ground, 2)

            fill(disk)
            # The files' last pages still have room for a few small appends: send until the
            # disk really refuses one.
            for key in range(100, 300):
                _, refused_full = ground.send(m.Ping(key=key))
                ground.wait(
                    lambda inbox, seq=refused_full: any(
                        isinstance(x[1], (m.Rejected, m.Completed)) and x[1].tc_seq == seq for x in inbox
                    ),
                    30,
                )
                if any(isinstance(x[1], m.Rejected) and x[1].tc_seq == refused_full for x in ground.inbox):
                    break
            report = refusal(ground, refused_full)
            assert report.code == ResponseCode.BUS_STORAGE_FULL and "full" in report.reason
            assert bus.bus.switch.is_on(), "the payload stays powered"
            (disk / "filler").unlink()
            wait_for(lambda: bus.bus.storage.ok, HANG_S, what="space again")
            ground.send(m.Ping(key=4))
            pong(ground, 4)
        log = bl.read_log(disk / "bus" / bl.LOG_FILE)
    events = [e["event"] for e in log if e.kind == bl.BUS_EVENT]
    # Once per transition: a real full disk may take a small write now and then (the last page of
    # a file has room), so a spell may be more than one, but the two always alternate.
    assert events[0] == "BUS_STORAGE_FULL" and events[-1] == "BUS_STORAGE_RESTORED" and len(events) >= 4
    assert all(a != b for a, b in zip(events, events[1:], strict=False)), events
    assert log[0].kind == bl.RUN_START, "the lines of the read-only start were kept and written"
    assert refused_ro not in executed(record) and refused_full not in executed(record)
