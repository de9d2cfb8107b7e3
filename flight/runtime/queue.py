"""The persistent task queue: an append-only journal of QUEUE_ENTRY records.

Every change (submit, priority, cancel, start, complete, fail) is one record appended and
fsynced before the change is acted on or acknowledged, so a SIGKILL at any instant leaves a
journal whose valid prefix is a consistent queue: nothing acknowledged is lost, nothing finished
runs again. A torn tail is cut off at open. When the journal grows long it is compacted into a
single snapshot record that atomically replaces the file (write, fsync, rename, fsync dir).
Format of the entries: docs/flight.md.
"""
from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field

from common.durable import DurableFS
from common.record import Kind, RecordError, decode, encode

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "running", "completed", "failed", "cancelled"
FINISHED = (COMPLETED, FAILED, CANCELLED)
COMPACT_AFTER = 512


@dataclass
class Task:
    task_id: str
    prompt: str
    images: list[str]
    max_new_tokens: int
    priority: int
    request: tuple[int, int, int, int]   # the UPLINK_TASK's (apid, source id, seq, type): reports refer to it
    content_hash: str
    order: int                           # arrival order: ties in priority run first-come first-served
    state: str = QUEUED
    starts: int = 0                      # times inference started (more than one = interrupted)
    code: int = 0
    reason: str = ""
    result: dict = field(default_factory=dict)
    reported: bool = False               # the final report (COMPLETED/FAILED) has left for the bus

    @property
    def interruptions(self) -> int:
        return max(0, self.starts - 1)


class TaskQueue:
    def __init__(self, directory: str, fs: DurableFS | None = None):
        self.fs = fs or DurableFS()
        self.directory = directory
        self.path = os.path.join(directory, "journal.log")
        self.tasks: dict[str, Task] = {}
        self._entries = 0
        self._next_order = 0
        self._lock = threading.RLock()
        self.recovered_bytes_dropped = 0
        self._open()

    # ---- journal -----------------------------------------------------------------------------
    def _open(self) -> None:
        self.fs.makedirs(self.directory)
        for name in self.fs.listdir(self.directory):
            if name.endswith(".tmp"):
                self.fs.remove(os.path.join(self.directory, name), sync=False)
        if not self.fs.exists(self.path):
            return
        buf = self.fs.read(self.path)
        pos = 0
        while pos < len(buf):
            try:
                rec, n = decode(buf, pos, expect_kind=Kind.QUEUE_ENTRY)
            except RecordError:
                break
            self._apply(rec.meta)
            self._entries += 1
            pos += n
        if pos != len(buf):
            self.recovered_bytes_dropped = len(buf) - pos
            self.fs.truncate(self.path, pos)

    def _append(self, entry: dict) -> None:
        with self._lock:
            self.fs.append(self.path, encode(Kind.QUEUE_ENTRY, entry).chunks)
            self._apply(entry)
            self._entries += 1
            if self._entries > COMPACT_AFTER:
                self.compact()

    def compact(self) -> None:
        """Replace the journal by one snapshot record (atomic)."""
        with self._lock:
            snapshot = {"op": "snapshot", "tasks": [asdict(t) for t in self.tasks.values()],
                        "next_order": self._next_order}
            self.fs.write_atomic(self.path, encode(Kind.QUEUE_ENTRY, snapshot).chunks)
            self._entries = 1

    def _apply(self, e: dict) -> None:
        op = e["op"]
        if op == "snapshot":
            self.tasks = {}
            for t in e["tasks"]:
                t["request"] = tuple(t["request"])
                self.tasks[t["task_id"]] = Task(**t)
            self._next_order = int(e["next_order"])
            return
        if op == "submit":
            t = dict(e["task"])
            t["request"] = tuple(t["request"])
            self.tasks[t["task_id"]] = Task(**t)
            self._next_order = max(self._next_order, t["order"] + 1)
            return
        task = self.tasks.get(e["task_id"])
        if task is None:
            return  # an entry about a task the journal no longer has (cannot happen; ignore)
        if op == "priority":
            task.priority = int(e["priority"])
        elif op == "start":
            task.state = RUNNING
            task.starts += 1
        elif op == "complete":
            task.state = COMPLETED
            task.result = dict(e.get("result", {}))
        elif op == "reported":
            task.reported = True
        elif op in ("fail", "cancel"):
            task.state = FAILED if op == "fail" else CANCELLED
            task.code = int(e.get("code", 0))
            task.reason = str(e.get("reason", ""))

    # ---- operations ------------------------------------------------------------------------------
    def submit(self, task_id: str, prompt: str, images: list[str], max_new_tokens: int, priority: int,
               request: tuple[int, int, int, int], content_hash: str) -> Task:
        with self._lock:
            task = Task(task_id, prompt, list(images), int(max_new_tokens), int(priority), tuple(request),
                        content_hash, self._next_order)
            self._append({"op": "submit", "task": asdict(task)})
            return self.tasks[task_id]

    def set_priority(self, task_id: str, priority: int) -> None:
        self._append({"op": "priority", "task_id": task_id, "priority": int(priority)})

    def cancel(self, task_id: str, reason: str = "cancelled by command", code: int = 0) -> None:
        self._append({"op": "cancel", "task_id": task_id, "reason": reason, "code": code})

    def start(self, task_id: str) -> None:
        self._append({"op": "start", "task_id": task_id})

    def complete(self, task_id: str, result: dict) -> None:
        self._append({"op": "complete", "task_id": task_id, "result": result})

    def mark_reported(self, task_id: str) -> None:
        self._append({"op": "reported", "task_id": task_id})

    def unreported(self) -> list[Task]:
        """Finished tasks whose final report may not have reached the bus."""
        with self._lock:
            return [t for t in self.tasks.values() if t.state in FINISHED and not t.reported]

    def fail(self, task_id: str, code: int, reason: str) -> None:
        self._append({"op": "fail", "task_id": task_id, "code": int(code), "reason": reason[:400]})

    # ---- queries --------------------------------------------------------------------------------
    def get(self, task_id: str) -> Task | None:
        return self.tasks.get(task_id)

    def pending(self) -> list[Task]:
        """Unfinished tasks in run order: an interrupted (running) task first, then by priority
        (higher first), then by arrival."""
        with self._lock:
            waiting = [t for t in self.tasks.values() if t.state in (QUEUED, RUNNING)]
        return sorted(waiting, key=lambda t: (t.state != RUNNING, -t.priority, t.order))

    def depth(self) -> int:
        return len(self.pending())
