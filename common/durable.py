"""Durable file operations, in one place so that every write follows the sequences of
docs/record-format.md §5 and so that tests can substitute a file layer that simulates crashes,
full disks or a slow flash device.

`DurableFS` is the real thing (os calls + fsync). `ThrottledFS` wraps one with a token bucket so
that benchmarks can emulate a target device's storage bandwidth (see docs/benchmarks.md).

Two process-wide services sit under every DurableFS of a process:

- `write_watch` times every durable write and fsync, so that a payload can report a stalled disk
  (the longest write, and one still running) without ever waiting on it itself, and counts the
  bytes written (the storage's wear since the process started);
- storage fault injection (tests and red-team campaigns only; docs/flight.md "Storage"): when the
  environment variable OW_STORAGE_FAULTS names a control file, every DurableFS in the process
  reads it (again whenever it changes) and behaves as a full, read-only, failing or stalling disk
  would for the paths it names. Unset in flight.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import json
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


#: The environment variable naming a storage fault control file (tests, red-team campaigns).
FAULTS_ENV = "OW_STORAGE_FAULTS"
#: Storage conditions by errno (`storage_condition`): what the environment does to a write,
#: never a fault of the data being written.
_CONDITIONS = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "full",
    errno.EROFS: "read_only",
    errno.EACCES: "read_only",
    errno.EPERM: "read_only",
    errno.EIO: "error",
}


def storage_condition(exc: BaseException) -> str | None:
    """`full`, `read_only` or `error` when `exc` is the storage refusing a write (no space, a
    read-only or unwritable file system, an I/O error), else None. Such a failure is an
    environment condition: it is reported and waited out, never charged to a task."""
    if isinstance(exc, OSError):
        return _CONDITIONS.get(exc.errno)  # type: ignore[arg-type]
    return None


class WriteWatch:
    """How long durable writes and fsyncs take, process-wide (thread-safe, cheap).

    `longest_since_reset()` is the longest one finished since the last reset, or the age of the
    oldest one still running if that is longer: a write that has been stuck for 8 s shows as
    8 s before it ends."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        self._running: dict[int, float] = {}
        self._ids = itertools.count()
        self._longest = 0.0
        self._written = 0

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self._written += nbytes

    def written(self) -> int:
        """Bytes written through every DurableFS of this process since it started (its data
        storage's share of wear; HOUSEKEEPING `written_bytes`)."""
        with self._lock:
            return self._written

    @contextlib.contextmanager
    def timing(self):
        token, start = next(self._ids), self.clock()
        with self._lock:
            self._running[token] = start
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(token, None)
                self._longest = max(self._longest, self.clock() - start)

    def running_for(self) -> float:
        """How long the oldest write still running has run (0 when none is)."""
        with self._lock:
            oldest = min(self._running.values(), default=None)
        return 0.0 if oldest is None else self.clock() - oldest

    def longest_since_reset(self, reset: bool = False) -> float:
        with self._lock:
            longest = self._longest
            if reset:
                self._longest = 0.0
        return max(longest, self.running_for())


#: Every DurableFS of this process reports here.
write_watch = WriteWatch()


class StorageFaults:
    """Injected storage faults, read from a JSON control file that a test rewrites at will:

        {"mode": "ok" | "full" | "read_only" | "eio",
         "under": ["/path/prefix", ...],   # the faults apply below these paths (default: all)
         "free_bytes": N,                  # "full" only: N more bytes may still be written, and
                                           # every file removed through DurableFS frees its size
         "stall_s": S}                     # every fsync below `under` first waits S seconds

    The control file is read again whenever its modification time or size changes, so a test
    flips a running process between full, read-only and free by rewriting it (atomically)."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self.mode, self.under, self.stall_s = "ok", (), 0.0
        self.free_bytes: int | None = None

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            st = None
        seen = None if st is None else (st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return
        self._seen = seen
        spec: dict = {}
        if st is not None:
            try:
                with open(self.path, encoding="utf-8") as f:
                    spec = json.load(f)
            except (OSError, ValueError):
                spec = {}
        self.mode = str(spec.get("mode", "ok"))
        self.under = tuple(os.path.abspath(p) for p in spec.get("under", ()))
        self.stall_s = float(spec.get("stall_s", 0.0))
        free = spec.get("free_bytes")
        self.free_bytes = None if free is None else int(free)

    def _applies(self, path: str) -> bool:
        if not self.under:
            return True
        path = os.path.abspath(path)
        return any(path == p or path.startswith(p + os.sep) for p in self.under)

    def before_write(self, path: str, nbytes: int) -> None:
        """Raise the error the emulated disk gives for writing `nbytes` new bytes at `path`."""
        with self._lock:
            self._refresh()
            if not self._applies(path):
                return
            if self.mode == "read_only":
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
            if self.mode == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
            if self.mode == "full":
                if self.free_bytes is None or nbytes > self.free_bytes:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                self.free_bytes -= nbytes

    def before_remove(self, path: str) -> None:
        with self._lock:
            self._refresh()
            if self._applies(path) and self.mode in ("read_only", "eio"):
                code = errno.EROFS if self.mode == "read_only" else errno.EIO
                raise OSError(code, os.strerror(code), path)

    def removed(self, path: str, nbytes: int) -> None:
        with self._lock:
            if self.mode == "full" and self.free_bytes is not None and self._applies(path):
                self.free_bytes += nbytes

    def before_fsync(self, path: str) -> None:
        with self._lock:
            self._refresh()
            stall = self.stall_s if self._applies(path) else 0.0
            failing = self.mode == "eio" and self._applies(path)
        if stall > 0:
            time.sleep(stall)
        if failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    def emulates(self, path: str, mode: str) -> bool:
        with self._lock:
            self._refresh()
            return self.mode == mode and self._applies(path)

    def free(self, path: str) -> int | None:
        """Free bytes as the emulated disk reports them (None: not emulated there)."""
        with self._lock:
            self._refresh()
            if not self._applies(path) or self.mode == "ok":
                return None
            return (self.free_bytes or 0) if self.mode == "full" else None


def _faults_from_env() -> StorageFaults | None:
    path = os.environ.get(FAULTS_ENV)
    return StorageFaults(path) if path else None


#: Injected faults for this process, or None (always None in flight).
storage_faults: StorageFaults | None = _faults_from_env()


def _write_all(fd: int, chunks, path: str = "") -> int:
    total = 0
    try:
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if storage_faults is not None:
                storage_faults.before_write(path, view.nbytes)
            while view:
                n = os.write(fd, view)
                total += n
                view = view[n:]
    finally:
        write_watch.wrote(total)  # what reached the disk counts as wear even if the write then failed
    return total


def _fsync(fd: int, path: str) -> None:
    with write_watch.timing():
        if storage_faults is not None:
            storage_faults.before_fsync(path)
        os.fsync(fd)


class DurableFS:
    """Plain POSIX files with explicit fsync of files and directories."""

    def write_atomic(self, path: str, chunks) -> int:
        """write(tmp); fsync(tmp); rename(tmp, path); fsync(dir). Returns bytes written.

        The temporary file's name is unique to this call (temp_name), so concurrent writers of
        one path each rename a complete file of their own: the last rename wins, none fails."""
        directory = os.path.dirname(path)
        tmp = temp_name(path)
        if storage_faults is not None:
            storage_faults.before_write(tmp, 0)  # a read-only or failing disk refuses the create
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            n = _write_all(fd, chunks, path)
            _fsync(fd, path)
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
        if storage_faults is not None:
            storage_faults.before_write(path, 0)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        start = os.fstat(fd).st_size
        try:
            n = _write_all(fd, chunks, path)
            _fsync(fd, path)
        except BaseException:
            try:
                os.ftruncate(fd, start)
                _fsync(fd, path)
            except OSError:
                pass
            os.close(fd)
            raise
        os.close(fd)
        if created:
            self.fsync_dir(os.path.dirname(path))
        return n

    def truncate(self, path: str, size: int) -> None:
        if storage_faults is not None:
            storage_faults.before_remove(path)  # shrinking needs no space, but a writable disk
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            _fsync(fd, path)
        finally:
            os.close(fd)

    def remove(self, path: str, sync: bool = True) -> None:
        if storage_faults is not None:
            storage_faults.before_remove(path)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return
        if storage_faults is not None:
            storage_faults.removed(path, size)
        if sync:
            self.fsync_dir(os.path.dirname(path))

    def makedirs(self, path: str) -> None:
        if not os.path.isdir(path):
            if storage_faults is not None:
                storage_faults.before_write(path, 0)
            os.makedirs(path, exist_ok=True)
            self.fsync_dir(os.path.dirname(os.path.abspath(path)))

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            _fsync(fd, path or ".")
        finally:
            os.close(fd)

    def read_only(self, path: str) -> bool:
        """Whether the file system holding `path` is mounted read-only (or emulated so)."""
        if storage_faults is not None and storage_faults.emulates(path, "read_only"):
            return True
        try:
            return bool(os.statvfs(_existing(path)).f_flag & os.ST_RDONLY)
        except OSError:
            return False

    def free_bytes(self, path: str) -> int:
        """Bytes free for this process on the file system holding `path` (0 if unknown)."""
        if storage_faults is not None:
            emulated = storage_faults.free(path)
            if emulated is not None:
                return emulated
        try:
            st = os.statvfs(_existing(path))
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def open_read(self, path: str):
        return open(path, "rb", buffering=0)

    def charge_read(self, nbytes: int) -> None:
        """Account for bytes read through `open_read` (used by bandwidth emulation)."""

    def emulated_read_rate(self) -> float | None:
        """The bytes/s this layer holds reads to (target-device emulation), or None: the
        machine's own speed. The restore planner prices checkpoint reads at it, so every layer
        that wraps another must pass it through."""
        return None

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
            size = os.stat(path).st_size
            os.unlink(path)
        except OSError:
            return
        if storage_faults is not None:
            storage_faults.removed(path, size)


def _existing(path: str) -> str:
    """`path`, or its nearest ancestor that exists (a data directory not made yet is on the file
    system of the directory above it)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def is_storage_fault(exc: BaseException) -> bool:
    """The storage refused a write (`storage_condition`): no space, read-only, I/O error."""
    return storage_condition(exc) is not None


def best_effort(write, *args) -> bool:
    """Run a write that may wait for better storage (tidying, a second copy, a rewrite the next
    open repeats): True if it was done, False if the storage refused it. Any other error is
    raised as usual."""
    try:
        write(*args)
    except OSError as exc:
        if storage_condition(exc) is None:
            raise
        return False
    return True


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

    def emulated_read_rate(self) -> float | None:
        return self.read_bucket.rate / self.weight if self.read_bucket else None

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
