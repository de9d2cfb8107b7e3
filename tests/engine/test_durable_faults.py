"""Storage fault injection and the write watch (common/durable.py): the emulated disk refuses,
frees and stalls as a real one would, for the paths it names only, and follows its control file
as the file changes."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest
from testkit import HANG_S

from common import durable
from common.durable import DurableFS, StorageFaults, WriteWatch, storage_condition


def _control(path, **spec) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(spec, f)
    os.replace(tmp, path)
    # a rewrite within the same mtime tick must still be seen: the size differs, or force it
    os.utime(path, ns=(time.time_ns(), time.time_ns()))


@pytest.fixture
def faults(tmp_path, monkeypatch):
    control = tmp_path / "faults.json"
    injected = StorageFaults(str(control))
    monkeypatch.setattr(durable, "storage_faults", injected)
    return control


def test_full_disk_budget_and_removal_frees(tmp_path, faults):
    data = tmp_path / "data"
    data.mkdir()
    fs = DurableFS()
    fs.write_atomic(str(data / "before"), [b"x" * 100])
    _control(faults, mode="full", under=[str(data)], free_bytes=150)
    fs.write_atomic(str(data / "a"), [b"a" * 100])
    with pytest.raises(OSError) as info:
        fs.append(str(data / "b"), [b"b" * 100])
    assert info.value.errno == errno.ENOSPC and storage_condition(info.value) == "full"
    assert not (data / "b").exists() or (data / "b").stat().st_size == 0  # nothing half-written
    fs.remove(str(data / "a"))  # frees its 100 bytes
    fs.append(str(data / "b"), [b"b" * 100])
    assert fs.free_bytes(str(data)) == 50
    # outside `under` the disk is the real one
    fs.write_atomic(str(tmp_path / "elsewhere"), [b"y" * 1000])


def test_read_only_eio_and_recovery(tmp_path, faults):
    data = tmp_path / "data"
    data.mkdir()
    fs = DurableFS()
    fs.write_atomic(str(data / "kept"), [b"k"])
    _control(faults, mode="read_only", under=[str(data)])
    for action in (
        lambda: fs.write_atomic(str(data / "new"), [b"n"]),
        lambda: fs.remove(str(data / "kept")),
        lambda: fs.makedirs(str(data / "sub")),
    ):
        with pytest.raises(OSError) as info:
            action()
        assert storage_condition(info.value) == "read_only"
    assert (data / "kept").read_bytes() == b"k"
    _control(faults, mode="eio", under=[str(data)])
    with pytest.raises(OSError) as info:
        fs.append(str(data / "kept"), [b"more"])
    assert storage_condition(info.value) == "error"
    _control(faults, mode="ok")
    fs.append(str(data / "kept"), [b"more"])
    assert (data / "kept").read_bytes() == b"kmore"


def test_stalled_fsync_shows_in_the_watch_while_it_runs(tmp_path, faults, monkeypatch):
    watch = WriteWatch()
    monkeypatch.setattr(durable, "write_watch", watch)
    _control(faults, stall_s=0.6)
    # The first fsync also waits for the test to have looked at the watch: the write is certainly
    # still running when the test looks, however late a loaded machine lets the test run.
    looked = threading.Event()
    stall = durable.storage_faults.before_fsync

    def held_then_stalled(path: str) -> None:
        looked.wait(HANG_S)
        stall(path)

    monkeypatch.setattr(durable.storage_faults, "before_fsync", held_then_stalled)
    fs = DurableFS()
    done = threading.Event()
    writer = threading.Thread(target=lambda: (fs.write_atomic(str(tmp_path / "f"), [b"1"]), done.set()))
    writer.start()
    deadline = time.monotonic() + HANG_S
    while watch.running_for() < 0.3:
        assert time.monotonic() < deadline and not done.is_set(), "the watch never saw the stalled write running"
        time.sleep(0.01)
    assert watch.longest_since_reset() >= 0.3
    looked.set()
    writer.join(HANG_S)
    assert done.is_set()
    assert watch.longest_since_reset(reset=True) >= 0.6  # one fsync alone (the file's, then the directory's)
    assert watch.longest_since_reset() == 0.0


def test_unrelated_errors_are_not_storage_conditions():
    assert storage_condition(ValueError("x")) is None
    assert storage_condition(OSError(errno.ENOENT, "missing")) is None
    assert storage_condition(OSError(errno.ENOSPC, "full")) == "full"
