"""What the inference worker is working on, shared between the payload's threads.

The worker writes it (a task starts, a unit of work ends, the queue runs dry); the main thread
reads it for HEARTBEAT and HOUSEKEEPING, the command thread for CANCEL_TASK. Each change
replaces one frozen `Progress` under a lock, so a reader always gets a consistent snapshot --
never one task's id with another's phase or counts -- and never waits on more than the swap.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from common.wire import TaskPhase


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

    def snapshot(self) -> Progress:
        with self._lock:
            return self._progress

    def start(self, task: str, phase: TaskPhase) -> None:
        """The worker takes `task` (worker thread)."""
        self._swap(Progress(task, phase, 0, 0))

    def idle(self) -> None:
        """The worker has no task (worker thread)."""
        self._swap(IDLE)

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

    def _swap(self, progress: Progress) -> None:
        with self._lock:
            self._progress = progress


__all__ = ["IDLE", "CurrentWork", "Progress"]
