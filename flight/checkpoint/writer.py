"""Checkpoint writer: durable writes off the compute thread, in submission order.

At most two records are alive at once, the one being written and one waiting, so checkpointing
never keeps more than two blocks' worth of state (a payload computer shares its RAM with the
GPU). State copied for a record (`make_args`) is copied only once there is room for it.

Records are committed in the order they were submitted. A full disk skips the record with an
event; any other write error stops the request (it surfaces on the compute thread).

A record submitted as optional (an intermediate vision state, which the next one supersedes) is
dropped when the writer still has work outstanding, instead of making the compute thread wait
behind it: on storage slower than the compute, a fixed cadence would otherwise turn every
optional record into a stall.

A background record (`vision.out`, whose tensors the request keeps in memory anyway) is written
by a second thread that gives way to the ordered records between slices of its payload: the
prefill blocks that follow it are not queued behind one large write. It may therefore commit
after records submitted later; what it holds is also recomputable, so no order is needed.
"""

from __future__ import annotations

import queue
import threading
import time

import torch

from common.durable import is_storage_fault
from flight.events import EngineEvent, Events


def state_bytes(obj) -> int:
    """Bytes of tensor data reachable from a record's arguments (tensors, dicts, sequences)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


class CheckpointWriter:
    def __init__(self, events: Events, async_writes: bool = True, after_commit=None):
        self.events = events
        self.after_commit = after_commit  # (what, nbytes) -> None; tests raise a simulated cut here
        self.async_writes = async_writes
        self.bytes_committed = 0
        self.records_committed = 0
        self.records_skipped = 0
        self.records_deferred = 0  # optional records dropped because the writer was busy
        self.busy_seconds = 0.0  # time spent writing (for throughput figures)
        # Tensor bytes held by records submitted and not yet written, and its high-water mark:
        # the state checkpointing keeps alive beyond what the computation itself holds.
        self.held_bytes = 0
        self.held_bytes_peak = 0
        # ordered records queued or being written (tensor bytes), and when and with how many
        # bytes the one being written started: what the cadence weighs a vision state against
        self._backlog_bytes = 0
        self._writing: tuple[float, int] | None = None
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._background: threading.Thread | None = None
        self._counters = threading.Lock()
        if async_writes:
            self._queue = queue.Queue()
            self._slots = threading.Semaphore(2)  # records alive: being written + waiting
            self._thread = threading.Thread(target=self._loop, name="checkpoint-writer", daemon=True)
            self._thread.start()

    def submit(self, what: str, fn, *args, optional: bool = False, make_args=None) -> bool:
        """Write (sync) or enqueue (async) one record; `fn(*args)` performs the store call. An
        optional record is dropped (False) when an earlier one is still queued or being written.
        `make_args`, instead of `args`, copies the record's state: it is called only once there is
        room for one more record, so the copy never makes a third one alive."""
        self._raise_pending()
        if optional and self._queue is not None and self._queue.unfinished_tasks > 0:
            self.records_deferred += 1
            self.events(EngineEvent.CHECKPOINT_DEFERRED, record=what, reason="writer busy")
            return False
        held = state_bytes(args)  # arguments passed in are alive while this waits for room
        self._hold(held)
        if self._queue is not None:
            self._slots.acquire()  # released by the writer thread once a record is written
        if make_args is not None:
            args = make_args()
            copied = state_bytes(args)
            self._hold(copied - held)
            held = copied
        if self._queue is None:
            try:
                self._execute(what, fn, args, {})
            finally:
                self._hold(-held)
        else:
            with self._counters:
                self._backlog_bytes += held
            self._queue.put((what, fn, args, {}, held))
        return True

    def backlog(self) -> tuple[int, float, int]:
        """(tensor bytes of the ordered records queued or being written, seconds the one being
        written has been under way, its bytes); zeros when idle, and always for a synchronous
        writer, which writes on the caller's thread."""
        with self._counters:
            if self._writing is None:
                return self._backlog_bytes, 0.0, 0
            started, nbytes = self._writing
            return self._backlog_bytes, time.perf_counter() - started, nbytes

    def take_peak(self) -> int:
        """The high-water mark of held bytes so far; the next one starts from what is held now."""
        with self._counters:
            peak, self.held_bytes_peak = self.held_bytes_peak, self.held_bytes
            return peak

    def _hold(self, nbytes: int) -> None:
        with self._counters:
            self.held_bytes += nbytes
            self.held_bytes_peak = max(self.held_bytes_peak, self.held_bytes)

    def submit_background(self, what: str, fn, *args) -> None:
        """Write one record behind the ordered ones: `fn(*args, between_slices=...)` must call
        `between_slices()` before each slice of its payload, where it waits while ordered
        records are outstanding. One background record at a time; synchronous writers write it
        at once. Its tensors must be ones the computation keeps anyway: they are not counted in
        `held_bytes`."""
        self._raise_pending()
        if self._queue is None:
            self._execute(what, fn, args, {"between_slices": None})
            return
        self._join_background()
        background = threading.Thread(
            target=self._background_loop, args=(what, fn, args), name="checkpoint-writer-background", daemon=True
        )
        # Kept only once started: a start that fails (no memory for the thread's stack) raises
        # here, and close() must not then hide that error behind a join of a thread never started.
        background.start()
        self._background = background

    def _yield_to_ordered(self) -> None:
        waited = time.perf_counter()
        assert self._queue is not None  # only ordered writes, which run on the queue, call this
        self._queue.join()
        with self._counters:
            self.busy_seconds -= time.perf_counter() - waited  # waiting is not writing

    def _background_loop(self, what, fn, args) -> None:
        try:
            if self._error is None:
                self._execute(what, fn, args, {"between_slices": self._yield_to_ordered})
        except BaseException as exc:
            self._error = exc

    def _join_background(self) -> None:
        if self._background is not None:
            self._background.join()
            self._background = None

    def drain(self) -> None:
        """Wait until everything submitted is durable (or skipped)."""
        if self._queue is not None:
            self._queue.join()
            self._join_background()
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        self._join_background()
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _execute(self, what, fn, args, kwargs) -> None:
        start = time.perf_counter()
        try:
            n = fn(*args, **kwargs)
        except OSError as exc:
            with self._counters:
                self.busy_seconds += time.perf_counter() - start
                if not is_storage_fault(exc):
                    raise
                self.records_skipped += 1
            self.events(EngineEvent.CHECKPOINT_WRITE_FAILED, record=what, errno=exc.errno, reason=str(exc.strerror))
            return
        with self._counters:
            self.busy_seconds += time.perf_counter() - start
            if n is None:
                return
            self.bytes_committed += n
            self.records_committed += 1
        self.events(EngineEvent.CHECKPOINT_COMMITTED, record=what, bytes=n)
        if self.after_commit is not None:
            self.after_commit(what, n)

    def _loop(self) -> None:
        jobs = self._queue  # the queue this thread was started to serve
        assert jobs is not None
        while True:
            item = jobs.get()
            if item is None:
                jobs.task_done()
                return
            what, fn, args, kwargs, held = item
            with self._counters:
                self._writing = (time.perf_counter(), held)
            try:
                if self._error is None:
                    self._execute(what, fn, args, kwargs)
            except BaseException as exc:
                self._error = exc
            finally:
                del args, kwargs, item  # the state goes before the record counts as written
                self._hold(-held)
                with self._counters:
                    self._backlog_bytes -= held
                    self._writing = None
                self._slots.release()
                jobs.task_done()
