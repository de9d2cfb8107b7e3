"""What the inference worker is working on, shared between the payload's threads.

The worker writes it (a task starts, a unit of work ends, the queue runs dry); the main thread
reads it for HEARTBEAT and HOUSEKEEPING, the command thread for CANCEL_TASK. Each change
replaces one frozen `Progress` under a lock, so a reader always gets a consistent snapshot --
never one task's id with another's phase or counts -- and never waits on more than the swap.

The running task's `StopToken` (flight/events.py) is kept with it under the same lock: a
CANCEL_TASK for the task the worker is on cancels its token (`cancel`), and the engine ends it at
its next unit boundary. The cancel is remembered by task id until the worker has carried it out
(`cancel_done`): a task that left the engine for another reason (an image to be sent again) is
cancelled at its next start.

The engine at work is kept here too (`set_engine`, `engine`): the worker sets it around each
run, the main thread reads it when a SHUTDOWN_WARNING asks for a checkpoint soon.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

from common.wire import TaskPhase
from flight.events import StopToken


@dataclass(frozen=True)
class Progress:
    task: str | None = None  # the task id, None when the worker is idle
    phase: TaskPhase | None = None
    done: int = 0  # units of work of the phase done
    total: int = 0


IDLE = Progress()


class CurrentWork:
    """The worker's `Progress`, one snapshot at a time (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._progress = IDLE
        self._stop: StopToken | None = None  # the running task's, None when idle
        self._cancelled: set[str] = set()  # cancels asked while the task was current, not yet carried out
        self._engine: Any = None  # the Engine running the current task (typed loosely: it imports torch)

    def snapshot(self) -> Progress:
        with self._lock:
            return self._progress

    def start(self, task: str, phase: TaskPhase, stop: StopToken | None = None) -> None:
        """The worker takes `task`, which `stop` can end early (worker thread)."""
        with self._lock:
            self._progress = Progress(task, phase, 0, 0)
            self._stop = stop
            if stop is not None and task in self._cancelled:
                stop.cancel()

    def set_engine(self, engine: Any) -> None:
        """The engine now running the current task, or None once its run ended (worker thread)."""
        with self._lock:
            self._engine = engine

    def engine(self) -> Any:
        """The engine at work, or None (any thread)."""
        with self._lock:
            return self._engine

    def idle(self) -> None:
        """The worker has no task (worker thread)."""
        with self._lock:
            self._progress = IDLE
            self._stop = None

    def cancel(self, task: str) -> bool:
        """Ask the running task to end at its next unit boundary, if `task` is the one the worker
        is on (command thread); False if it is not."""
        with self._lock:
            if self._progress.task != task:
                return False
            self._cancelled.add(task)
            if self._stop is not None:
                self._stop.cancel()
            return True

    def cancel_done(self, task: str) -> None:
        """The worker ended `task` for its cancel (worker thread)."""
        with self._lock:
            self._cancelled.discard(task)

    def advance(self, phase: TaskPhase, done: int, total: int) -> Progress:
        """A unit of work of the current task ended (worker thread); the snapshot before it."""
        with self._lock:
            before = self._progress
            self._progress = replace(before, phase=phase, done=done, total=total)
            return before

    def set_phase(self, phase: TaskPhase) -> None:
        """The current task's phase changes with no unit of work (it completed; worker thread)."""
        with self._lock:
            self._progress = replace(self._progress, phase=phase)


__all__ = ["IDLE", "CurrentWork", "Progress"]
