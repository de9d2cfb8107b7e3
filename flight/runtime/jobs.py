"""The command thread: the jobs the other threads hand it, in order, and its own periodic
work between them (docs/flight.md "Threads").

Every handler that writes, and every write the main thread would otherwise wait on (a report's
bookkeeping once it has left, a PowerStateChange's verdict, the boot's own writes), is a job
here; the worker hands it the profile's saves. A disk that stalls stalls this thread only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from common.wire import EventId

from .reports import COMMAND_THREAD, Faults

#: The command thread's housekeeping (health expiry, deferred reports, the storage check, saving
#: a dirty state, the telemetry reservation) runs this often when no command keeps it busy.
TICK_S = 0.5
#: Bytes held in checkpoints are counted again this often (a walk of tasks/).
CHECKPOINT_COUNT_EVERY_S = 5.0

Job = Callable[[], object]


class CommandJobs:
    """The command thread's queue of jobs and its loop. Until the thread is started (`start`), a
    job handed to `later` runs at once on the caller's thread: in-process tests and fuzzers
    dispatch without one."""

    def __init__(self, stop: threading.Event, faults: Faults):
        self.stop = stop
        self.faults = faults
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.queued_only = False  # a test's stand-in for a busy command thread: jobs wait, none runs

    def later(self, job: Job) -> None:
        """Run `job` on the command thread, in order (inline when there is none)."""
        if self._thread is None and not self.queued_only:
            job()
        else:
            self._jobs.put(job)

    def put(self, job: Job) -> None:
        """Queue `job` for the command thread, whether or not it runs yet."""
        self._jobs.put(job)

    def pending(self) -> int:
        return self._jobs.qsize()

    def start(self, tick: Callable[[bool], None]) -> threading.Thread:
        """Start the command thread; `tick(count_checkpoints)` is its own housekeeping."""
        thread = self._thread = threading.Thread(target=self._loop, args=(tick,), name=COMMAND_THREAD, daemon=True)
        thread.start()
        return thread

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, tick: Callable[[bool], None]) -> None:
        """Runs the handlers that write and every write the main thread must not wait on, in
        order, then its own housekeeping every TICK_S."""
        next_tick = 0.0
        next_count = 0.0
        while not self.stop.is_set():
            try:
                job = self._jobs.get(timeout=TICK_S)
            except queue.Empty:
                job = None
            if job is not None:
                try:
                    job()
                except Exception as exc:  # noqa: BLE001 - the thread itself never ends on a fault
                    self.faults.fault(EventId.MAIN_LOOP_FAULT, "command thread", exc)
                if not self._jobs.empty():
                    continue  # commands first; the housekeeping below once they are done
            now = time.monotonic()
            if now < next_tick:
                continue
            next_tick = now + TICK_S
            try:
                tick(now >= next_count)
            except Exception as exc:  # noqa: BLE001
                self.faults.fault(EventId.MAIN_LOOP_FAULT, "command thread housekeeping", exc)
            if now >= next_count:
                next_count = now + CHECKPOINT_COUNT_EVERY_S


__all__ = ["CHECKPOINT_COUNT_EVERY_S", "CommandJobs", "TICK_S"]
