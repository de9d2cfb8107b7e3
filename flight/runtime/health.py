"""Health and safety (in the manner of cFS Health & Safety): no item may kill every boot.

An *item* is one thing the payload handles that stored or received state can make fatal: a
command (`command:<TYPE>:<digest of its body>`, so a re-delivered or re-sent copy is the same
item), a task (`task:<id>`), a task's final report (`report:<id>`), the engine load
(`engine:load`). While a thread handles an item, its id is in that thread's slot of the
*breadcrumb* file (`health/inflight`). The breadcrumb is written without fsync on purpose: it only
has to outlive the process, not the power, and costs a pwrite per item.

At boot the breadcrumb left by the previous boot tells what it was handling when it ended. Such
an ending is an *abnormal exit* when the process died by itself: its own crash record says so
(`health/crash.log`, written by faulthandler on a fatal signal and by the last-resort exception
hooks), or the bus says so -- POWER_STATE at connection carries `after_fault`: the bus cut the
previous power because the payload exited on its own, stopped its heartbeat or never finished
booting. A trace cut, a command or a bus restart is not abnormal and counts for nothing. Until
the bus has said (at most VERDICT_WAIT_S), the items of the previous boot are *held*: the worker
does not start such a task and such a report is not sent, so an item that kills at once cannot
loop before it is counted. Without a word from the bus the exit is not counted.

A handler that raises (a caught fault, the payload keeps running) counts the same way.

Each abnormal exit or fault at an item is counted durably (`health/state.rec`); at EXIT_BOUND
the item is *quarantined*: not handled again (a command is rejected QUARANTINED, a task is held
back and reported FAILED(QUARANTINED), a report is not sent), with an ITEM_QUARANTINED event,
until the ground releases it (RELEASE_QUARANTINE). A task that progresses (a unit of work done)
resets its count: dying in different places is not a loop.

Fault injection (tests, red-team campaigns): the environment variable OW_FAULT,
`<action>:<item prefix>[,...]` with action `kill` (SIGKILL the process as it starts the item, as a
native crash or the kernel's OOM killer would) or `raise` (RuntimeError in the handler), e.g.
`OW_FAULT=kill:task:t-bad`. Unset in flight.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import signal
import struct
import sys
import threading
import time
import zlib
from typing import TextIO

import msgpack

from common.durable import DurableFS, storage_condition
from common.record import Kind, RecordError, decode, encode
from common.wire.ids import MAX_ITEM_BYTES, MAX_REASON_BYTES
from common.wire.text import clip_utf8

#: Abnormal exits (or faults) at one item before it is quarantined.
EXIT_BOUND = 3
#: How long items of the previous boot are held for the bus's word on how that boot ended.
VERDICT_WAIT_S = 5.0
#: Items whose exits are counted, and items in quarantine, at most (the oldest go first).
MAX_COUNTED = 256
MAX_QUARANTINED = 1024
MAIN, WORKER, COMMANDS = 0, 1, 2
SLOTS = 3
_SLOT_BYTES = 512
_SLOT_HEAD = struct.Struct("<II")  # payload length, crc32
ENGINE_ITEM = "engine:load"


def task_item(task_id: str) -> str:
    return f"task:{task_id}"


def report_item(task_id: str) -> str:
    return f"report:{task_id}"


def command_item(message) -> str:
    body = msgpack.packb(message.pack(), use_bin_type=True)
    digest = hashlib.sha256(int(message.TYPE).to_bytes(2, "big") + body).hexdigest()[:16]
    return f"command:{message.TYPE.name}:{digest}"


def item_task_id(item: str) -> str | None:
    kind, _, rest = item.partition(":")
    return rest if kind in ("task", "report") else None


class Health:
    def __init__(
        self,
        directory: str,
        fs: DurableFS | None = None,
        *,
        boot: int,
        bound: int = EXIT_BOUND,
        on_event=None,
        log=None,
        fault_spec: str | None = None,
    ):
        self.fs = fs or DurableFS()
        self.directory = directory
        self.boot = boot
        self.bound = int(bound)
        self.on_event = on_event or (lambda kind, item, text: None)
        self.log = log
        self.state_path = os.path.join(directory, "state.rec")
        self.inflight_path = os.path.join(directory, "inflight")
        self.crash_path = os.path.join(directory, "crash.log")
        self._lock = threading.RLock()
        self.exits: dict[str, list] = {}  # item -> [count, last boot, reason]
        self.quarantine: dict[str, list] = {}  # item -> [exits, boot quarantined, reason, sequence]
        self.abnormal_exits = 0
        self.corrupt = False
        self._suspects: dict[str, str] = {}  # items held until the bus says how the last boot ended
        self._suspects_since = time.monotonic()
        self._faults = _parse_faults(os.environ.get("OW_FAULT") if fault_spec is None else fault_spec)
        #: counts changed in memory and not yet on disk (the disk refused, or saves are deferred)
        self._dirty = False
        #: set by the payload once its command thread runs (`defer_saves`): counts are then saved
        #: there (flush), never by a thread that must not wait on the disk
        self._saves_deferred = False
        try:
            self.fs.makedirs(directory)
        except OSError as exc:
            if storage_condition(exc) is None:
                raise
        self._load()
        previous = self._read_inflight()
        crash = self._take_crash_record()
        self._inflight_fd: int | None = None
        try:
            self._inflight_fd = os.open(self.inflight_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # A read-only or failing disk (or, on a fresh data directory, the health directory it
            # refused to make): no breadcrumb this boot; the bus's boot-loop guard remains.
            if log is not None:
                log.warning("health_breadcrumb_unavailable", error=str(exc))
        for slot in range(SLOTS):
            self._write_slot(slot, None)
        if previous:
            if crash:
                self._count(previous, f"boot {boot - 1} crashed: {crash}")
            else:
                self._suspects = {item: f"boot {boot - 1} ended while handling it" for item in previous}
                self._suspects_since = time.monotonic()

    # ---- durable state -------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.fs.exists(self.state_path):
            return
        try:
            rec, _ = decode(self.fs.read(self.state_path), expect_kind=Kind.HEALTH_STATE)
            self.exits = {k: list(v) for k, v in rec.meta["exits"].items()}
            self.quarantine = {k: list(v) for k, v in rec.meta["quarantine"].items()}
            self.abnormal_exits = int(rec.meta.get("abnormal_exits", 0))
        except (RecordError, KeyError, TypeError, ValueError, AttributeError, OSError):
            self.corrupt = True  # start counting afresh: at worst an item gets EXIT_BOUND more tries

    def _save(self) -> None:
        if len(self.exits) > MAX_COUNTED:
            for item in sorted(self.exits, key=lambda k: self.exits[k][1])[: len(self.exits) - MAX_COUNTED]:
                del self.exits[item]
        if len(self.quarantine) > MAX_QUARANTINED:
            for item in sorted(self.quarantine, key=lambda k: self.quarantine[k][3])[
                : len(self.quarantine) - MAX_QUARANTINED
            ]:
                del self.quarantine[item]
        meta = {"exits": self.exits, "quarantine": self.quarantine, "abnormal_exits": self.abnormal_exits}
        self.fs.write_atomic(self.state_path, encode(Kind.HEALTH_STATE, meta).chunks)

    def _persist(self) -> None:
        """Save the counts now, or mark them for `flush` (saves deferred, or the disk refused):
        a full or read-only disk never loses a count that is in memory, nor the event about it."""
        with self._lock:
            self._dirty = True
            if self._saves_deferred:
                return
        self.flush()

    def unsaved(self) -> bool:
        """Whether a count is in memory only (the worker starts no task until it is on disk)."""
        with self._lock:
            return self._dirty

    def defer_saves(self) -> None:
        """From now on a count is saved by `flush` only (the payload's command thread). Under the
        lock, as `_persist` reads it: the main thread switches it while other threads count."""
        with self._lock:
            self._saves_deferred = True

    def flush(self) -> None:
        """Save counts changed since the last save (a no-op when there are none). A disk that
        refuses leaves them dirty for the next flush."""
        with self._lock:
            if not self._dirty:
                return
            try:
                self._save()
            except OSError as exc:
                if self.log is not None:
                    self.log.warning("health_state_not_saved", error=str(exc))
                return
            self._dirty = False

    # ---- breadcrumb ----------------------------------------------------------------------------------
    def _read_inflight(self) -> list[str]:
        items: list[str] = []
        try:
            with open(self.inflight_path, "rb") as f:
                data = f.read(SLOTS * _SLOT_BYTES)
        except OSError:
            return items
        for slot in range(SLOTS):
            block = data[slot * _SLOT_BYTES : (slot + 1) * _SLOT_BYTES]
            if len(block) < _SLOT_HEAD.size:
                continue
            length, crc = _SLOT_HEAD.unpack_from(block)
            payload = block[_SLOT_HEAD.size : _SLOT_HEAD.size + length]
            if length == 0 or len(payload) != length or zlib.crc32(payload) != crc:
                continue
            try:
                boot, item = msgpack.unpackb(payload)
            except (ValueError, TypeError, msgpack.UnpackException):
                continue
            if isinstance(item, str) and item and boot < self.boot:
                items.append(item)
        return list(dict.fromkeys(items))

    def _write_slot(self, slot: int, item: str | None) -> None:
        if self._inflight_fd is None:
            return
        payload = b"" if item is None else msgpack.packb([self.boot, item])
        block = _SLOT_HEAD.pack(len(payload), zlib.crc32(payload)) + payload
        try:
            os.pwrite(self._inflight_fd, block.ljust(_SLOT_BYTES, b"\0"), slot * _SLOT_BYTES)
        except OSError:
            pass  # the breadcrumb is best effort: a full page cache on a full disk loses one crumb

    @contextlib.contextmanager
    def handling(self, item: str, slot: int):
        """Mark `item` as being handled by this thread (`slot`) for the duration."""
        self._write_slot(slot, item)
        try:
            self._inject(item)
            yield
        finally:
            self._write_slot(slot, None)

    def _inject(self, item: str) -> None:
        for action, prefix in self._faults:
            if item.startswith(prefix):
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"injected fault at {item}")

    # ---- crash record ----------------------------------------------------------------------------
    def _take_crash_record(self) -> str:
        try:
            with open(self.crash_path, "rb") as f:
                text = f.read(64 << 10).decode("utf-8", "replace").strip()
        except OSError:
            return ""
        if text:
            try:
                os.replace(self.crash_path, self.crash_path + ".previous")  # kept for diagnosis
            except OSError:
                pass  # a read-only disk: read again next boot, where the breadcrumb is gone
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[0] if lines else ""

    def arm_crash_record(self) -> None:
        """From now on faulthandler writes a fatal signal's traceback to `crash.log` and the
        exception hooks one line for an exception that escaped everything else (called by the
        payload process as it starts; process-wide, so not by an in-process test's Health)."""
        self._crash_file: TextIO
        try:
            self._crash_file = open(self.crash_path, "a", buffering=1)
        except OSError:  # a read-only disk: the crash goes to the payload's output, which the bus keeps
            self._crash_file = sys.stderr
        faulthandler.enable(file=self._crash_file, all_threads=True)
        previous_hook, previous_thread_hook = sys.excepthook, threading.excepthook

        def record(kind: str, exc_type, exc) -> None:
            try:
                self._crash_file.write(f"{kind}: {exc_type.__name__}: {clip_utf8(str(exc), 200)}\n")
                self._crash_file.flush()
            except Exception:  # the last resort must not raise
                pass

        def excepthook(exc_type, exc, tb):
            record("uncaught exception", exc_type, exc)
            previous_hook(exc_type, exc, tb)

        def thread_excepthook(args):
            if args.exc_type is not SystemExit:
                record(
                    f"uncaught exception in thread {getattr(args.thread, 'name', '?')}", args.exc_type, args.exc_value
                )
            previous_thread_hook(args)

        sys.excepthook, threading.excepthook = excepthook, thread_excepthook

    # ---- counting ------------------------------------------------------------------------------------
    def _count(self, items, reason: str) -> list[str]:
        """One abnormal exit (or fault) at each of `items`. Returns the items quarantined now."""
        quarantined = []
        with self._lock:
            self.abnormal_exits += 1
            for item in items:
                if item in self.quarantine:
                    continue
                count = self.exits.get(item, [0, 0, ""])[0] + 1
                self.exits[item] = [count, self.boot, clip_utf8(reason, MAX_REASON_BYTES)]
                if count >= self.bound:
                    self.quarantine[item] = [
                        count,
                        self.boot,
                        clip_utf8(reason, MAX_REASON_BYTES),
                        max((q[3] for q in self.quarantine.values()), default=0) + 1,
                    ]
                    del self.exits[item]
                    quarantined.append(item)
            self._persist()
        for item in items:
            if item in quarantined:
                self.on_event(
                    "quarantined",
                    item,
                    f"{item} quarantined after {self.bound} abnormal exits or faults; last: {reason}",
                )
            elif item in self.exits:
                self.on_event("abnormal_exit", item, f"{item}: {reason} ({self.exits[item][0]}/{self.bound})")
        return quarantined

    def fault(self, item: str, reason: str) -> bool:
        """A handler at `item` raised (the payload carries on). Returns True if that quarantined it."""
        return bool(self._count([item], reason))

    def verdict(self, after_fault: bool | None) -> list[str]:
        """The bus said how the previous boot ended. Returns the items quarantined now."""
        with self._lock:
            suspects, self._suspects = self._suspects, {}
        if not suspects:
            return []
        if after_fault:
            return self._count(list(suspects), f"boot {self.boot - 1} ended by itself (the bus power-cycled it)")
        if self.log is not None:
            self.log.info("health_previous_boot_cut", items=list(suspects), after_fault=after_fault)
        return []

    def awaiting_verdict(self) -> bool:
        """Whether items of the previous boot are held until the bus says how it ended."""
        with self._lock:
            return bool(self._suspects)

    def expire(self) -> None:
        """No word from the bus in time: the previous boot's end is not counted."""
        if self._suspects and time.monotonic() - self._suspects_since > VERDICT_WAIT_S:
            self.verdict(None)

    def held(self, item: str) -> bool:
        if self._suspects:
            self.expire()
        return item in self._suspects

    def progress(self, item: str) -> None:
        """`item` (a task) did a unit of work: whatever killed it before is behind it."""
        if item in self.exits:
            with self._lock:
                if self.exits.pop(item, None) is not None:
                    self._persist()

    # ---- quarantine --------------------------------------------------------------------------------
    def is_quarantined(self, item: str) -> bool:
        return item in self.quarantine

    def release(self, item: str) -> bool:
        with self._lock:
            if self.quarantine.pop(item, None) is None:
                return False
            self.exits.pop(item, None)
            self._persist()
        return True

    def listing(self) -> list[tuple[str, int, str]]:
        """(item, exits, reason), most recently quarantined first."""
        with self._lock:
            ordered = sorted(self.quarantine.items(), key=lambda kv: -kv[1][3])
        return [(item[:MAX_ITEM_BYTES], int(q[0]), q[2]) for item, q in ordered]


def _parse_faults(spec: str | None) -> list[tuple[str, str]]:
    faults = []
    for part in (spec or "").split(","):
        action, _, prefix = part.strip().partition(":")
        if action in ("kill", "raise") and prefix:
            faults.append((action, prefix))
    return faults
