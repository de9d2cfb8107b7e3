"""The bus's own disk (docs/bus.md "The bus's own disk"): what it writes -- the command store, the
run log, the telemetry sequence reservation -- may fail with ENOSPC, EROFS or EIO. None of that
stops the bus: `StorageWatch` says which of those writers is failing and why, and tells the bus
once per transition between "every writer writes" and "one does not" (BUS_STORAGE_FULL /
BUS_STORAGE_RESTORED events); `TolerantSequenceCounter` hands out telemetry numbers from memory
while its reservation cannot be written.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from common import log
from common.durable import DurableFS, storage_condition
from common.wire import DurableSequenceCounter, SequenceCounter, SequenceStateError

_log = log.get("hil.bus")

#: While a writer fails, wall seconds between its retries (a failing write is cheap, but a bus
#: loop that retried every 20 ms would spend its time on a disk that is not coming back yet).
STORAGE_RETRY_S = 1.0


def condition_of(exc: BaseException) -> str:
    """`full`, `read_only` or `error` for any OSError a write gave (an errno the storage layer
    does not classify is still the disk's fault, never a reason to stop the bus)."""
    return storage_condition(exc) or "error"


class StorageWatch:
    """Which of the bus's writers are failing, and since when. `on_change(failing, detail)` is
    called once per transition: `failing` True when the first writer fails, False when the last
    one writes again."""

    def __init__(self, on_change: Callable[[bool, str], None]):
        self.on_change = on_change
        #: writer -> (condition, error text)
        self.failing: dict[str, tuple[str, str]] = {}
        self.since: float | None = None
        self.transitions = 0

    @property
    def ok(self) -> bool:
        return not self.failing

    @property
    def condition(self) -> str | None:
        """The worst condition among the failing writers (read_only > full > error), or None."""
        conditions = {c for c, _ in self.failing.values()}
        for name in ("read_only", "full", "error"):
            if name in conditions:
                return name
        return None

    def failed(self, writer: str, exc: BaseException) -> None:
        condition = condition_of(exc)
        text = getattr(exc, "strerror", None) or str(exc)
        first = not self.failing
        known = self.failing.get(writer)
        self.failing[writer] = (condition, text)
        if known is None:
            _log.error("bus_storage_failed", writer=writer, condition=condition, error=text)
        if first:
            self.since = time.monotonic()
            self.transitions += 1
            self.on_change(True, f"{writer}: {text}")

    def succeeded(self, writer: str) -> None:
        if writer not in self.failing:
            return
        del self.failing[writer]
        _log.info("bus_storage_writer_restored", writer=writer)
        if not self.failing:
            spell = time.monotonic() - (self.since or time.monotonic())
            self.since = None
            self.transitions += 1
            self.on_change(False, f"after {spell:.1f} s")


class TolerantSequenceCounter(DurableSequenceCounter):
    """The bus's telemetry sequence numbers: reserved in durable blocks as DurableSequenceCounter
    does, but a reservation that cannot be written does not stop the numbering -- numbers go on
    from memory and the reservation is tried again (at most once per STORAGE_RETRY_S). Telemetry
    receivers use the numbers to notice loss, not to refuse packets (docs/wire-protocol.md §6.2),
    so the worst a bus killed during such a spell can do is number a few packets twice after its
    restart."""

    def __init__(self, path: str | os.PathLike, watch: StorageWatch, reserve: int = 1024, fs: DurableFS | None = None):
        self.watch = watch
        self._retry_at = 0.0
        try:
            super().__init__(path, reserve=reserve, fs=fs)
        except (OSError, SequenceStateError) as exc:
            # Unreadable: number from 0 in memory (receivers only count gaps) and write anew.
            _log.error("bus_tm_sequence_unreadable", path=os.fspath(path), error=str(exc))
            SequenceCounter.__init__(self)
            self.path, self.reserve, self._fs = os.fspath(path), reserve, fs or DurableFS()
            self._reserved_until = {}

    def _persist(self, apid: int, reserved_until: int) -> None:
        now = time.monotonic()
        if now < self._retry_at:
            return
        try:
            super()._persist(apid, reserved_until)
        except OSError as exc:
            self._retry_at = now + STORAGE_RETRY_S
            self.watch.failed("telemetry sequence", exc)
        else:
            self.watch.succeeded("telemetry sequence")
