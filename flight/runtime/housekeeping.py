"""The payload's periodic work: HEARTBEAT and HOUSEKEEPING from memory (main thread), the
stall watch on the data disk (main thread), and the command thread's tick (health expiry, the
reports held back, the storage check, a dirty state saved, the telemetry reservation, the bytes
held in checkpoints counted)."""

from __future__ import annotations

import os
import time

from common.durable import DurableFS, write_watch
from common.wire import Apid, EventId
from common.wire import messages as m
from common.wire.seq import AheadSequenceCounter

from .config import DataPaths
from .current import CurrentWork
from .health import Health
from .outbox import Outbox
from .queue import TaskQueue
from .reports import FinalReports
from .state import Latest, PersistentState
from .storage import Storage

#: A durable write running this long is reported as a stall (STORAGE_STALL) ...
STALL_REPORT_S = 2.0
#: ... at most this often.
STALL_EVENT_EVERY_S = 30.0

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_memory_bytes() -> int | None:
    """This process's resident memory now (HOUSEKEEPING `memory_rss_bytes`): the second field of
    /proc/self/statm, in pages. One small read from procfs, never the disk. None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


def checkpoint_bytes(tasks_dir: str) -> int:
    """Bytes under tasks/ (a walk of the directory: the command thread's to do)."""
    total = 0
    for d, _, files in os.walk(tasks_dir):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(d, f))
            except OSError:
                pass
    return total


class Housekeeping:
    """What the payload says of itself on its own schedule, and the command thread's upkeep."""

    def __init__(
        self,
        *,
        paths: DataPaths,
        fs: DurableFS,
        state: PersistentState,
        storage: Storage,
        queue: TaskQueue,
        current: CurrentWork,
        health: Health,
        tm_counter: AheadSequenceCounter,
        outbox: Outbox,
        final_reports: FinalReports,
        started: float,
    ):
        self.paths = paths
        self.fs = fs
        self.state = state
        self.storage = storage
        self.queue = queue
        self.current = current
        self.health = health
        self.tm_counter = tm_counter
        self.outbox = outbox
        self.final_reports = final_reports
        self.started = started
        # Bytes held in checkpoints: counted by the command thread, read by the main thread
        # (HOUSEKEEPING never walks the disk there).
        self.checkpoint_bytes_seen: Latest[int] = Latest(0)
        self._stall_reported_at = -1e9  # main thread only

    # ---- main thread: from memory --------------------------------------------------------------
    def heartbeat(self, now: float) -> m.Heartbeat:
        work = self.current.snapshot()
        return m.Heartbeat(
            boot_count=self.state.counters_now().boot_count,
            uptime_s=now - self.started,
            current_task=work.task,
            phase=work.phase,
        )

    def message(self) -> m.Housekeeping:
        """From memory: the main thread sends it and never waits on the disk (the checkpoint
        bytes are counted by the command thread; the free space is one statvfs; the resident
        memory one procfs read; the bytes written a counter of the durable file layer)."""
        c = self.state.counters_now()
        storage = self.storage
        now = self.current.snapshot()
        return m.Housekeeping(
            queue_depth=self.queue.depth(),
            current_task=now.task,
            phase=now.phase,
            progress_done=now.done,
            progress_total=now.total,
            checkpoint_bytes=self.checkpoint_bytes_seen.get(),
            disk_free_bytes=max(0, self.fs.free_bytes(self.paths.root)),
            boot_count=c.boot_count,
            command_count=c.command_count,
            error_count=c.error_count,
            uptime_s=time.monotonic() - self.started,
            storage_state=storage.condition().state,
            longest_write_s=round(write_watch.longest_since_reset(reset=True), 3),
            reserve_bytes=storage.reserve_held,
            memory_rss_bytes=resident_memory_bytes(),
            written_bytes=write_watch.written(),
        )

    def watch_stall(self, now: float) -> None:
        """A durable write that has run for STALL_REPORT_S is reported (at most every
        STALL_EVENT_EVERY_S): the payload is waiting on its disk, not hung."""
        running = write_watch.running_for()
        if running >= STALL_REPORT_S and now - self._stall_reported_at >= STALL_EVENT_EVERY_S:
            self._stall_reported_at = now
            self.outbox.event(
                EventId.STORAGE_STALL,
                f"a durable write has been waiting on the data disk for {running:.1f} s; commands that "
                "change state are answered once it completes, PING, STATUS and heartbeats go on",
            )

    # ---- command thread ----------------------------------------------------------------------
    def tick(self, count_checkpoints: bool) -> None:
        self.health.expire()
        self.health.flush()
        self.final_reports.send_deferred()
        self.storage.check()
        if self.storage.allows_writes():
            try:
                if self.state.unsaved():
                    self.state.save()
                if self.tm_counter.wants_reserve():
                    self.tm_counter.reserve([Apid.PAYLOAD])
            except OSError as exc:
                if not self.storage.failed(exc, "saving the payload's state"):
                    raise
        if count_checkpoints:
            self.checkpoint_bytes_seen.set(checkpoint_bytes(self.paths.tasks))


__all__ = ["Housekeeping", "STALL_EVENT_EVERY_S", "STALL_REPORT_S", "checkpoint_bytes", "resident_memory_bytes"]
