"""State shared between the payload's threads, each piece behind its own lock.

    PersistentState  boot count, command/error counters and the replay guard (state/state.rec)
    Latest           one value one thread publishes and others read (the checkpoint bytes the
                     command thread counts, this boot's WINDOW_HISTORY)

What the worker is on (and the engine it runs) is `CurrentWork` (current.py); the images awaited
again are `AwaitedImages` (images.py). Everything else a part holds is its own thread's.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from common.durable import DurableFS, storage_condition
from common.record import Kind, RecordError, decode, encode
from common.wire import ReplayGuard


@dataclass
class Counters:
    boot_count: int = 0
    command_count: int = 0
    error_count: int = 0


class PersistentState:
    """Boot count, command/error counters and the replay guard, in one record (atomic replace).

    Changed by the main thread (the guard, as each telecommand arrives) and the command thread;
    `save()` writes a consistent copy and may be called from any thread but the main one, which
    never waits on the disk: a change that is not saved at once is `unsaved()` until the command
    thread's next save."""

    def __init__(self, directory: str, fs: DurableFS):
        self.fs, self.path = fs, os.path.join(directory, "state.rec")
        self.lock = threading.RLock()
        self._dirty = False
        try:
            fs.makedirs(directory)
            fs.remove_stale_temps(directory)
        except OSError as exc:
            if storage_condition(exc) is None:
                raise  # a read-only or full disk: the state is read, and saved once it can be
        self.counters, self.guard, self.corrupt = Counters(), ReplayGuard(), False
        if fs.exists(self.path):
            try:
                rec, _ = decode(fs.read(self.path), expect_kind=Kind.GUARD_STATE)
                self.counters = Counters(**rec.meta["counters"])
                self.guard = ReplayGuard.from_bytes(bytes(rec.meta["guard"]))
            except (RecordError, KeyError, TypeError, ValueError, OSError):
                self.corrupt = True  # start a fresh guard; reported as STATE_CORRUPT

    def counters_now(self) -> Counters:
        """A consistent copy of the counters (for HEARTBEAT and HOUSEKEEPING)."""
        with self.lock:
            return replace(self.counters)

    def unsaved(self) -> bool:
        """Whether a change is not on disk yet."""
        with self.lock:
            return self._dirty

    def mark_unsaved(self) -> None:
        """A change made under `lock` by another part (the replay guard's), for the next save."""
        with self.lock:
            self._dirty = True

    def count_boot(self) -> int:
        with self.lock:
            self.counters.boot_count += 1
            self._dirty = True
            return self.counters.boot_count

    def count_command(self) -> None:
        with self.lock:
            self.counters.command_count += 1
            self._dirty = True

    def count_error(self) -> None:
        with self.lock:
            self.counters.error_count += 1
            self._dirty = True

    def save(self) -> None:
        with self.lock:
            meta = {"counters": dict(self.counters.__dict__), "guard": self.guard.to_bytes()}
            self._dirty = False
        try:
            self.fs.write_atomic(self.path, encode(Kind.GUARD_STATE, meta).chunks)
        except BaseException:
            self.mark_unsaved()
            raise


T = TypeVar("T")


class Latest(Generic[T]):
    """The latest value one thread published for others to read (thread-safe)."""

    def __init__(self, value: T):
        self._lock = threading.Lock()
        self._value = value

    def get(self) -> T:
        with self._lock:
            return self._value

    def set(self, value: T) -> None:
        with self._lock:
            self._value = value


__all__ = ["Counters", "Latest", "PersistentState"]
