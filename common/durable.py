"""Durable file operations, in one place so that every write follows the sequences of
docs/record-format.md §5 and so that tests can substitute a file layer that simulates crashes,
full disks or a slow flash device.

`DurableFS` is the real thing (os calls + fsync). `ThrottledFS` wraps one with a token bucket so
that benchmarks can emulate a target device's storage bandwidth (see docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import errno
import itertools
import os
import re
import threading
import time
from dataclasses import dataclass, field

#: Temporary files of write_atomic: `.<name>.<pid>.<thread>.<n>.tmp`, unique per writer, so two
#: threads (or processes) replacing the same file never write, rename or remove each other's.
_TEMP_RE = re.compile(r"^\..+\.(\d+)\.\d+\.\d+\.tmp$")
_temp_numbers = itertools.count()


def temp_name(path: str) -> str:
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_numbers)}.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_all(fd: int, chunks) -> int:
    total = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            total += n
            view = view[n:]
    return total


class DurableFS:
    """Plain POSIX files with explicit fsync of files and directories."""

    def write_atomic(self, path: str, chunks) -> int:
        """write(tmp); fsync(tmp); rename(tmp, path); fsync(dir). Returns bytes written.

        The temporary file's name is unique to this call (temp_name), so concurrent writers of
        one path each rename a complete file of their own: the last rename wins, none fails."""
        directory = os.path.dirname(path)
        tmp = temp_name(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            n = _write_all(fd, chunks)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._discard(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
        self.fsync_dir(directory)
        return n

    def append(self, path: str, chunks) -> int:
        """append; fsync(file); on failure the file is truncated back to its previous length."""
        created = not os.path.exists(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        start = os.fstat(fd).st_size
        try:
            n = _write_all(fd, chunks)
            os.fsync(fd)
        except BaseException:
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
            raise
        os.close(fd)
        if created:
            self.fsync_dir(os.path.dirname(path))
        return n

    def truncate(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, path: str, sync: bool = True) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        if sync:
            self.fsync_dir(os.path.dirname(path))

    def makedirs(self, path: str) -> None:
        if not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            self.fsync_dir(os.path.dirname(os.path.abspath(path)))

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def open_read(self, path: str):
        return open(path, "rb", buffering=0)

    def charge_read(self, nbytes: int) -> None:
        """Account for bytes read through `open_read` (used by bandwidth emulation)."""

    def read(self, path: str) -> memoryview:
        """The whole file, in a 64-byte aligned buffer (see common.record.aligned_buffer)."""
        from common.record import aligned_buffer  # lazy: numpy; `ow --help` and the bus load this module

        with self.open_read(path) as f:
            size = os.fstat(f.fileno()).st_size
            view, got = aligned_buffer(size), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            return view[:got]

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove_stale_temps(self, directory: str) -> int:
        """Remove write_atomic temporaries left in `directory` by processes that no longer run
        (a cut between write and rename). Returns how many were removed."""
        removed = 0
        for name in self.listdir(directory):
            found = _TEMP_RE.match(name)
            if found is None and not (name.startswith(".") and name.endswith(".tmp")):
                continue
            if found is not None and int(found.group(1)) != os.getpid() and _pid_alive(int(found.group(1))):
                continue  # another live process is writing it
            if found is not None and int(found.group(1)) == os.getpid():
                continue
            self.remove(os.path.join(directory, name), sync=False)
            removed += 1
        return removed

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    @staticmethod
    def _discard(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


@dataclass
class TokenBucket:
    """Bandwidth limiter: `rate` bytes/s with a burst of `burst` bytes. Thread-safe."""

    rate: float
    burst: float = 4 << 20
    _tokens: float = field(default=0.0, init=False)
    _last: float = field(default_factory=time.monotonic, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def take(self, nbytes: float) -> float:
        """Block until `nbytes` may pass; returns the seconds slept."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


class ThrottledFS(DurableFS):
    """A DurableFS whose reads and writes are paced by token buckets (target-device emulation).

    The real operation runs first; the caller is then held until the bucket allows the bytes, so
    the observed time is max(real time, bytes / emulated bandwidth) as on a slower device. Writes
    are charged chunk by chunk as they are written, so a writer that interleaves two records (a
    background record giving way between slices) sees the device shared as a real one would be."""

    def __init__(self, read_bps: float | None, write_bps: float | None, weight: float = 1.0):
        self.read_bucket = TokenBucket(read_bps) if read_bps else None
        self.write_bucket = TokenBucket(write_bps) if write_bps else None
        # Each byte through this view is charged `weight` bytes of the buckets (`weighted`).
        self.weight = weight

    def weighted(self, weight: float) -> ThrottledFS:
        """The same emulated device (the same buckets, so the two share its bandwidth) for data
        whose bytes stand for `weight` times as much device time per byte as the data the
        bandwidths were set for. The testbench sets the bandwidths for a small model's checkpoint
        records, each byte of which stands for many bytes of a real model's; a task's inputs and
        images are as large as on the target, so they pass with weight < 1 (docs/hil.md)."""
        if not 0 < weight <= 1:
            raise ValueError(f"a storage weight is in (0, 1], not {weight}")
        view = copy.copy(self)
        view.weight = weight
        return view

    def _metered(self, chunks):
        for chunk in chunks:
            yield chunk  # written once the next one is asked for
            self.write_bucket.take(memoryview(chunk).nbytes * self.weight)

    def write_atomic(self, path, chunks):
        return super().write_atomic(path, self._metered(chunks) if self.write_bucket else chunks)

    def append(self, path, chunks):
        return super().append(path, self._metered(chunks) if self.write_bucket else chunks)

    def charge_read(self, nbytes: int) -> None:
        if self.read_bucket:
            self.read_bucket.take(nbytes * self.weight)

    def read(self, path):
        buf = super().read(path)
        self.charge_read(len(buf))
        return buf


def read_rate_of(hook) -> float | None:
    """The emulated bandwidth, in bytes/s, that a weight-read hook (`WeightStore.read_hook`)
    holds reads to: a `TokenBucket.take` (`--emulate-weight-read-mbps`), or a
    `ThrottledFS.charge_read` (weights through the checkpoint throttle, as the recovery bench
    reads them). None for no hook or one that throttles nothing: the weights are read at this
    machine's own speed."""
    owner = getattr(hook, "__self__", None)
    if isinstance(owner, TokenBucket):
        return owner.rate
    if isinstance(owner, ThrottledFS) and owner.read_bucket is not None:
        return owner.read_bucket.rate / owner.weight
    return None
