"""The payload's data storage as an environment condition (docs/flight.md "Storage").

A full, read-only, failing or stalled disk is something the environment does to the payload, not
something a task, a command or a report did. So a write that fails with ENOSPC, EROFS or EIO is
never counted against the item being handled (health and safety counts only faults of the item);
it moves the payload into a degraded *storage state*, which is reported once (an event and the
HOUSEKEEPING channel STORAGE_STATE) and waited out:

    ok          everything as usual
    full        no space beyond the reserve: new uplinks and image chunks are refused
                (STORAGE_FULL), checkpoints are skipped (tasks go on without them); the
                payload's own small records -- replay guard, queue, results, health -- are
                written into the space the reserve gave back
    read_only   nothing can be written: commands that change state are refused
                (STORAGE_READ_ONLY), PING, STATUS and queries are answered from memory, the
                worker starts no task and holds a finished result in memory until it can be stored
    error       the same for writes failing with I/O errors (STORAGE_ERROR)

The **reserve** is a file of `reserve_bytes` (`reserve/ballast`) written when there is space,
at first boot or once space returns. When the disk fills up (free space under LOW_WATER_BYTES, or
a write fails with ENOSPC), the ballast is removed: the space it held is what the payload's own
records use until the disk has room again. The state returns to `ok` on its own, once
`check()` -- called twice a second off the main loop -- has seen room for the reserve again
(full) or a probe write succeed (read-only, error) RESTORE_CHECKS times in a row, so a disk that
flaps between full and free does not flap the service.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass

from common.durable import DurableFS, storage_condition
from common.wire import StorageState
from flight.options import DEFAULT_RESERVE_BYTES  # noqa: F401  (re-exported: the payload's default)

#: Free space under which the disk counts as full (and the reserve is given back).
LOW_WATER_BYTES = 256 << 10
#: Checks in a row that must find the disk usable again before the state returns to `ok`.
RESTORE_CHECKS = 2
#: The reserve is written in pieces this large (one fsync at the end).
_BALLAST_PIECE = 1 << 20

_STATE_OF = {"full": StorageState.FULL, "read_only": StorageState.READ_ONLY, "error": StorageState.ERROR}


@dataclass(frozen=True)
class StorageCondition:
    """The storage state and why it was entered, read together."""

    state: StorageState
    reason: str  # "" while ok

    def refusal_errno(self, growth: bool) -> int | None:
        """The errno a write is refused with in this state, without trying it (None: try it)."""
        if self.state == StorageState.READ_ONLY:
            return errno.EROFS
        if self.state == StorageState.ERROR:
            return errno.EIO
        if self.state == StorageState.FULL and growth:
            return errno.ENOSPC
        return None


class Storage:
    """The storage state of one data directory, with its reserve. Thread-safe."""

    def __init__(
        self,
        data_dir: str,
        fs: DurableFS,
        reserve_bytes: int,
        *,
        on_change=None,
        log=None,
        clock=time.monotonic,
    ):
        self.data_dir = data_dir
        self.fs = fs
        self.reserve_bytes = max(0, int(reserve_bytes))
        self.ballast_path = os.path.join(data_dir, "reserve", "ballast")
        self.on_change = on_change if on_change is not None else (lambda state, previous, text: None)
        self.log = log
        self.clock = clock
        self._lock = threading.RLock()
        self._state = StorageState.OK
        self.since = clock()
        self._reason = ""
        self.reserve_held = 0
        self.free_bytes = 0
        self.skipped_writes = 0  # writes refused or failed while degraded (checkpoints, mostly)
        self._good_checks = 0

    # ---- what the state allows -------------------------------------------------------------------
    def condition(self) -> StorageCondition:
        """The state and its reason as one consistent pair (the disk's state changes on any thread)."""
        with self._lock:
            return StorageCondition(self._state, self._reason)

    def allows_growth(self) -> bool:
        """New data may be written (uplinks, images, checkpoints)."""
        return self._state == StorageState.OK

    def allows_writes(self) -> bool:
        """The payload's own small records may be written (into the reserve when full)."""
        return self._state in (StorageState.OK, StorageState.FULL)

    def refusal_errno(self, growth: bool) -> int | None:
        """The errno a write should be refused with now, without trying it (None: try it)."""
        return self.condition().refusal_errno(growth)

    def note_skipped_write(self) -> None:
        """A write refused while the disk is degraded, without trying it (GatedFS)."""
        with self._lock:
            self.skipped_writes += 1

    # ---- reporting -----------------------------------------------------------------------------
    def failed(self, exc: BaseException, what: str) -> bool:
        """A write failed with `exc`. True when that is a storage condition (then the state
        follows it); False for anything else, which the caller handles as it would have."""
        condition = storage_condition(exc)
        if condition is None:
            return False
        detail = getattr(exc, "strerror", None) or str(exc)
        self._enter(_STATE_OF[condition], f"{what}: {detail}")
        return True

    def failed_errno(self, code: int | None, what: str) -> bool:
        """The same for a failure known only by its errno (the engine's skipped checkpoints)."""
        if code is None:
            return False
        return self.failed(OSError(code, os.strerror(code)), what)

    def _enter(self, state: StorageState, reason: str) -> None:
        with self._lock:
            self._good_checks = 0
            if self._state == state or (self._state != StorageState.OK and state == StorageState.FULL):
                # Already degraded: a full disk seen while read-only or failing changes nothing.
                self.skipped_writes += 1
                return
            previous, self._state, self.since, self._reason = self._state, state, self.clock(), reason
        # Outside the lock: removing the ballast waits on the disk, and the main thread reads the
        # condition for HOUSEKEEPING (it never waits on the disk). Only this transition releases it.
        released = self._release_reserve() if state == StorageState.FULL else 0
        self.free_bytes = self.fs.free_bytes(self.data_dir)
        text = self._describe(state, reason, released)
        if self.log is not None:
            self.log.warning("storage_degraded", state=state.value, previous=previous.value, reason=reason)
        self.on_change(state, previous, text)

    def _describe(self, state: StorageState, reason: str, released: int) -> str:
        if state == StorageState.FULL:
            return (
                f"data storage full ({self.free_bytes} bytes free; {reason}); reserve of {released} bytes "
                "released for the payload's own records; new uplinks and images refused, checkpoints "
                "skipped until space returns"
            )
        what = "read-only" if state == StorageState.READ_ONLY else "failing with I/O errors"
        return (
            f"data storage {what} ({reason}); commands that change state refused, PING and STATUS "
            "answered, no task started until it can be written again"
        )

    # ---- the reserve ----------------------------------------------------------------------------
    def open(self) -> None:
        """At boot: the reserve as found, written if missing and there is room; the disk's state."""
        try:
            self.reserve_held = self.fs.size(self.ballast_path)
        except OSError:
            self.reserve_held = 0
        self.free_bytes = self.fs.free_bytes(self.data_dir)
        if self.fs.read_only(self.data_dir):
            self._enter(StorageState.READ_ONLY, "mounted read-only at boot")
        elif self.reserve_held < self.reserve_bytes and self.free_bytes >= self.reserve_bytes + LOW_WATER_BYTES:
            self._write_reserve()
        elif self.free_bytes < LOW_WATER_BYTES:
            self._enter(StorageState.FULL, "too little space at boot")

    def _write_reserve(self) -> bool:
        try:
            self.fs.makedirs(os.path.dirname(self.ballast_path))
            self.fs.remove_stale_temps(os.path.dirname(self.ballast_path))
            pieces, rest = divmod(self.reserve_bytes, _BALLAST_PIECE)
            zero = bytes(_BALLAST_PIECE)
            chunks = [zero] * pieces + ([bytes(rest)] if rest else [])
            self.fs.write_atomic(self.ballast_path, chunks)
        except OSError as exc:
            if storage_condition(exc) is None:
                raise
            return False
        self.reserve_held = self.reserve_bytes
        return True

    def _release_reserve(self) -> int:
        released = self.reserve_held
        try:
            self.fs.remove(self.ballast_path)
        except OSError:
            return 0
        self.reserve_held = 0
        return released

    # ---- watching -----------------------------------------------------------------------------
    def check(self) -> None:
        """Twice a second, off the main loop: notice a disk filling up before a write fails,
        and return to `ok` once the disk takes writes again."""
        self.free_bytes = self.fs.free_bytes(self.data_dir)
        state = self._state
        if state == StorageState.OK:
            if self.fs.read_only(self.data_dir):
                self._enter(StorageState.READ_ONLY, "remounted read-only")
            elif self.free_bytes < LOW_WATER_BYTES:
                self._enter(StorageState.FULL, f"{self.free_bytes} bytes free")
            return
        if state == StorageState.FULL:
            usable = self.free_bytes >= self.reserve_bytes + LOW_WATER_BYTES
        else:
            usable = self._probe()
        with self._lock:
            self._good_checks = self._good_checks + 1 if usable else 0
            if self._good_checks < RESTORE_CHECKS:
                return
        if state != StorageState.FULL and self.free_bytes < self.reserve_bytes + LOW_WATER_BYTES:
            # Writable again, but without room: full, not ok.
            self._enter(StorageState.FULL, "writable again, but too little space")
            return
        if self.reserve_held < self.reserve_bytes and not self._write_reserve():
            with self._lock:
                self._good_checks = 0
            return
        self._restore()

    def _probe(self) -> bool:
        path = os.path.join(self.data_dir, "state", ".storage-probe")
        try:
            self.fs.write_atomic(path, [b"probe"])
            self.fs.remove(path)
        except OSError as exc:
            if storage_condition(exc) is None:
                raise
            return False
        return True

    def _restore(self) -> None:
        with self._lock:
            previous, self._state = self._state, StorageState.OK
            degraded_s = self.clock() - self.since
            self.since, self._reason, self._good_checks = self.clock(), "", 0
            skipped, self.skipped_writes = self.skipped_writes, 0
        self.free_bytes = self.fs.free_bytes(self.data_dir)
        text = (
            f"data storage usable again after {degraded_s:.0f} s {previous.value}: {self.free_bytes} bytes free, "
            f"reserve of {self.reserve_held} bytes held; {skipped} write(s) were skipped or refused meanwhile"
        )
        if self.log is not None:
            self.log.info("storage_restored", previous=previous.value, degraded_s=round(degraded_s, 3))
        self.on_change(StorageState.OK, previous, text)


class GatedFS(DurableFS):
    """A checkpoint store's file layer that asks the storage state first: while the disk is
    degraded a checkpoint write is refused at once (ENOSPC, EROFS or EIO, which the engine
    answers by skipping that record), so checkpoints never eat the space the reserve gave back
    for the payload's own records, and never wait on a disk known to refuse them. Everything else
    goes to the wrapped file layer (which may throttle, as the testbench's does)."""

    def __init__(self, inner: DurableFS, storage: Storage):
        self.inner, self.storage = inner, storage

    def _gate(self, path: str) -> None:
        code = self.storage.refusal_errno(growth=True)
        if code is not None:
            self.storage.note_skipped_write()
            raise OSError(code, f"{os.strerror(code)} (payload storage {self.storage.condition().state.value})", path)

    def write_atomic(self, path, chunks):
        self._gate(path)
        return self.inner.write_atomic(path, chunks)

    def append(self, path, chunks):
        self._gate(path)
        return self.inner.append(path, chunks)

    def makedirs(self, path):
        if not os.path.isdir(path):
            self._gate(path)
        return self.inner.makedirs(path)

    def truncate(self, path, size):
        return self.inner.truncate(path, size)

    def remove(self, path, sync=True):
        return self.inner.remove(path, sync)

    def fsync_dir(self, path):
        return self.inner.fsync_dir(path)

    def open_read(self, path):
        return self.inner.open_read(path)

    def charge_read(self, nbytes):
        return self.inner.charge_read(nbytes)

    def emulated_read_rate(self):
        # The restore planner prices checkpoint reads at the wrapped layer's emulated rate;
        # without this the payload planned reads at the cost model's rate while the throttle
        # below held them to the target's.
        return self.inner.emulated_read_rate()

    def read(self, path):
        return self.inner.read(path)

    def size(self, path):
        return self.inner.size(path)

    def exists(self, path):
        return self.inner.exists(path)

    def remove_stale_temps(self, directory):
        return self.inner.remove_stale_temps(directory)

    def listdir(self, path):
        return self.inner.listdir(path)

    def free_bytes(self, path):
        return self.inner.free_bytes(path)

    def read_only(self, path):
        return self.inner.read_only(path)
