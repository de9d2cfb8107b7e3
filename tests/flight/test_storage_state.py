"""The storage state machine and the telemetry counter that never waits on the disk, in process
(flight/runtime/storage.py, common/wire/seq.py); the payload around them is tested in
test_storage_conditions.py."""

from __future__ import annotations

import errno
import json
import os

import pytest

from common import durable
from common.durable import DurableFS, StorageFaults, ThrottledFS
from common.wire import StorageState
from common.wire.seq import AheadSequenceCounter
from flight.runtime.storage import LOW_WATER_BYTES, RESTORE_CHECKS, GatedFS, Storage


class Changes(list):
    def __call__(self, state, previous, text):
        self.append((state, previous, text))


@pytest.fixture
def faults(tmp_path, monkeypatch):
    control = tmp_path / "faults.json"
    monkeypatch.setattr(durable, "storage_faults", StorageFaults(str(control)))

    def set_(**spec):
        tmp = control.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, control)
        os.utime(control, ns=(os.stat(control).st_mtime_ns + 1_000_000,) * 2)

    return set_


def test_full_gives_back_the_reserve_and_returns_once_there_is_room(tmp_path, faults):
    data = tmp_path / "data"
    data.mkdir()
    changes = Changes()
    storage = Storage(str(data), DurableFS(), 1 << 20, on_change=changes)
    storage.open()
    assert storage.reserve_held == 1 << 20 and storage.condition().state == StorageState.OK
    faults(mode="full", free_bytes=0, under=[str(data)])
    storage.check()
    assert storage.condition().state == StorageState.FULL and storage.reserve_held == 0
    assert DurableFS().free_bytes(str(data)) == 1 << 20  # the reserve's space, for the payload's records
    assert changes[-1][0] == StorageState.FULL and "reserve" in changes[-1][2]
    # growth is refused before it reaches the disk; the payload's own records are not
    gated = GatedFS(DurableFS(), storage)
    with pytest.raises(OSError) as info:
        gated.write_atomic(str(data / "ckpt"), [b"x"])
    assert info.value.errno == errno.ENOSPC
    DurableFS().write_atomic(str(data / "state.rec"), [b"x" * 1000])
    # room again: back to ok only after RESTORE_CHECKS checks in a row, reserve written again
    faults(mode="ok")
    for _ in range(RESTORE_CHECKS - 1):
        storage.check()
        assert storage.condition().state == StorageState.FULL
    storage.check()
    assert storage.condition().state == StorageState.OK and storage.reserve_held == 1 << 20
    assert changes[-1][0] == StorageState.OK


def test_the_gate_passes_the_emulated_read_rate_through(tmp_path):
    """The restore planner prices checkpoint reads at the store's emulated read rate: the gate the
    payload puts over its checkpoint layer must show the throttle's rate below it, or the payload
    plans reads at the cost model's rate while the throttle holds them to the target's."""
    storage = Storage(str(tmp_path), DurableFS(), 0)
    assert GatedFS(ThrottledFS(0.5e6, None), storage).emulated_read_rate() == 0.5e6
    assert GatedFS(ThrottledFS(0.5e6, 2e6).weighted(0.25), storage).emulated_read_rate() == 2e6
    assert GatedFS(DurableFS(), storage).emulated_read_rate() is None
    assert GatedFS(ThrottledFS(None, 2e6), storage).emulated_read_rate() is None


def test_a_flapping_disk_does_not_flap_the_state(tmp_path, faults):
    data = tmp_path / "data"
    data.mkdir()
    changes = Changes()
    storage = Storage(str(data), DurableFS(), 0, on_change=changes)
    storage.open()
    for _ in range(5):
        faults(mode="full", free_bytes=0, under=[str(data)])
        storage.check()
        faults(mode="ok")
        storage.check()  # one good check: not yet trusted
    assert [c[0] for c in changes] == [StorageState.FULL]


def test_read_only_and_io_errors_are_conditions_and_probed_back(tmp_path, faults):
    data = tmp_path / "data"
    (data / "state").mkdir(parents=True)
    changes = Changes()
    storage = Storage(str(data), DurableFS(), 0, on_change=changes)
    storage.open()
    faults(mode="read_only", under=[str(data)])
    try:
        DurableFS().write_atomic(str(data / "state" / "x"), [b"1"])
    except OSError as exc:
        assert storage.failed(exc, "a write")
    assert storage.condition().state == StorageState.READ_ONLY and not storage.allows_writes()
    assert not storage.failed(ValueError("not the disk"), "a write")
    faults(mode="eio", under=[str(data)])
    storage.failed(OSError(errno.EIO, "I/O error"), "a write")
    assert storage.condition().state == StorageState.ERROR
    storage.failed(OSError(errno.ENOSPC, "full"), "a write")
    assert storage.condition().state == StorageState.ERROR  # a failing disk that is also full is still failing
    faults(mode="ok")
    for _ in range(RESTORE_CHECKS):
        storage.check()
    assert storage.condition().state == StorageState.OK
    assert [c[0] for c in changes] == [StorageState.READ_ONLY, StorageState.ERROR, StorageState.OK]


def test_too_little_space_at_boot_is_full_from_the_start(tmp_path, faults):
    data = tmp_path / "data"
    data.mkdir()
    faults(mode="full", free_bytes=LOW_WATER_BYTES - 1, under=[str(data)])
    storage = Storage(str(data), DurableFS(), 1 << 20)
    storage.open()
    assert storage.condition().state == StorageState.FULL


def test_telemetry_numbers_never_wait_on_the_disk_and_never_repeat_once_reserved(tmp_path, faults):
    path = tmp_path / "state" / "tm.bin"
    counter = AheadSequenceCounter(path, block=8)
    assert counter.wants_reserve() is False  # nothing issued yet
    counter.reserve([0x20])
    issued = [counter.next(0x20) for _ in range(5)]
    assert issued == [0, 1, 2, 3, 4] and counter.wants_reserve()  # under half a block left
    faults(mode="read_only", under=[str(tmp_path)])
    with pytest.raises(OSError):
        counter.reserve()
    issued += [counter.next(0x20) for _ in range(10)]  # past the reservation: still issued
    assert counter.unreserved == 7
    faults(mode="ok")
    counter.reserve()
    restarted = AheadSequenceCounter(path, block=8)  # a cut: the next boot starts past the reservation
    assert restarted.next(0x20) > max(issued)
    damaged = tmp_path / "state" / "bad.bin"
    damaged.write_bytes(b"not a counter")
    assert AheadSequenceCounter(damaged).reset_reason is not None


def test_the_guard_on_disk_never_holds_a_command_not_yet_run(tmp_path, model_dirs):
    """Found by the end-to-end test once the payload answered PINGs on its main thread: a number
    recorded as the command arrived was saved (by another command's save) before that command
    ran; a cut in between made its redelivery a 'replay', and an image chunk was lost. A command
    handed to the command thread is only checked on arrival and recorded when it runs."""
    from common.wire import Apid, NodeId, ReplayGuard
    from common.wire import encode as encode_packet
    from common.wire import messages as m
    from flight.engine import EngineOptions
    from flight.runtime.app import FlightApp, FlightConfig

    config = FlightConfig(
        str(tmp_path / "data"), model_dirs["qwen3-vl"], str(tmp_path / "keys"), "tcp://127.0.0.1:1", EngineOptions()
    )
    app = FlightApp(config)
    app.jobs.queued_only = True  # jobs queue up, as behind a busy command
    chunk = m.ImageChunk.split("a.png", b"\x89PNG" + bytes(100), chunk_bytes=64)[0]
    app.handle_packet(encode_packet(chunk, Apid.PAYLOAD, 5, source_id=NodeId.GROUND))
    app.handle_packet(encode_packet(m.Ping(key=1), Apid.PAYLOAD, 6, source_id=NodeId.GROUND))
    app.state.save()  # what the command thread's next save writes while the chunk still waits
    on_disk = FlightApp(config).state.guard
    on_disk.check(Apid.PAYLOAD, NodeId.GROUND, 5)  # not recorded: its redelivery is not a replay
    assert isinstance(on_disk, ReplayGuard) and on_disk.highest(Apid.PAYLOAD, NodeId.GROUND) == 6
    assert app.jobs.pending() == 1


def test_a_log_call_never_raises_on_a_full_disk():
    """The payload's and the bus's output is a file on a disk that may fill up: a log line the
    disk refuses is dropped and counted, never an exception in the caller (a heartbeat's, a
    handler's)."""
    import io

    from common import log

    class FullDisk(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    stream = FullDisk()
    log.setup("info", stream=stream)
    try:
        log.get(component="test").warning("storage_degraded", state="full")
    finally:
        log.setup("warning")


@pytest.mark.parametrize("mode", ["read_only", "eio"])
def test_a_first_boot_on_a_disk_that_takes_no_write_comes_up(tmp_path, model_dirs, faults, mode):
    """Found by the chaos campaign: a fresh data directory on a read-only (or failing) disk made
    the first boot exit (the health directory was refused, then opening its breadcrumb failed).
    Every part of the payload now opens what it can; the storage state says what it cannot."""
    from flight.engine import EngineOptions
    from flight.runtime.app import FlightApp, FlightConfig

    data = tmp_path / "data"
    faults(mode=mode, under=[str(data)])
    app = FlightApp(
        FlightConfig(str(data), model_dirs["qwen3-vl"], str(tmp_path / "keys"), "tcp://127.0.0.1:1", EngineOptions())
    )
    assert app.storage.condition().state == (StorageState.READ_ONLY if mode == "read_only" else StorageState.OK)
    assert app.queue.depth() == 0 and app.housekeeping.message().storage_state == app.storage.condition().state
