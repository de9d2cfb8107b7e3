"""The persistent task queue: a journal of the live tasks, and a store of the finished ones.

Every change (submit, priority, start, finish) is one QUEUE_ENTRY record appended and fsynced
before it is acted on or acknowledged, so a SIGKILL at any instant leaves a journal whose valid
records are a consistent queue: nothing acknowledged is lost, nothing finished runs again.

A task that finishes (completed, failed, cancelled) is written to the result store first
(results.py, durable), and only then leaves the journal (`finished` entry). Compaction rewrites
the journal as one record per *live* task, so neither the journal nor any record in it grows
with the payload's history: a record holds at most one task (at most ~17 KiB) and the live
set is bounded by the queue's capacity.

Reading is LevelDB-style (docs/flight.md): a damaged record is skipped -- by its own length when
its header still verifies, else up to the next record that verifies and carries this journal's
salt -- and every valid record after it is kept. Only bytes after the last valid record are a
torn tail. What was dropped is counted; the tasks whose state lived only there are named where
anything names them (a later entry about them, an intact header) and remembered in `lost.rec`,
so the ground can ask for them and a re-sent one is never taken for a new task silently.
Format of the entries: docs/flight.md.
"""

from __future__ import annotations

import os
import secrets
import struct
import threading
import zlib
from dataclasses import asdict, dataclass, field, replace

from common.durable import DurableFS, best_effort
from common.record import FIXED_HEADER, HEADER_LEN, MAGIC, MAX_META, Kind, RecordError, _parse_header, decode, encode
from common.wire.fields import check_name
from common.wire.header import RequestRef
from common.wire.ids import MAX_REASON_BYTES, MAX_RESULT_TEXT_BYTES
from common.wire.text import clip_utf8

from .results import DAMAGED, EVICTED, Finished, ResultStore

QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED = "queued", "running", "completed", "failed", "cancelled"
FINISHED = (COMPLETED, FAILED, CANCELLED)
COMPACT_AFTER = 512
#: Lost task ids remembered (most recent first) and reported to the ground.
MAX_LOST_REMEMBERED = 4096
_SALT = struct.Struct("<QI")  # salt, crc32 of it


@dataclass
class Task:
    task_id: str
    prompt: str
    images: list[str]
    max_new_tokens: int
    priority: int
    request: RequestRef  # the UPLINK_TASK's: reports refer to it
    content_hash: str
    order: int  # arrival order: ties in priority run first-come first-served
    state: str = QUEUED
    starts: int = 0  # times inference started (more than one = interrupted)
    code: int = 0
    reason: str = ""
    result: dict = field(default_factory=dict)
    reported: bool = False  # the final report (COMPLETED/FAILED) has left for the bus

    @property
    def interruptions(self) -> int:
        return max(0, self.starts - 1)


def request_ref(stored: RequestRef | dict | list | tuple) -> RequestRef:
    """A task's request as the journal and the result store hold it: by name (`apid`,
    `source_id`, `seq`, `message_type`), or the list of the four that older builds wrote."""
    if isinstance(stored, RequestRef):
        return stored
    if isinstance(stored, dict):
        return RequestRef(**{name: int(stored[name]) for name in RequestRef.__dataclass_fields__})
    apid, source_id, seq, message_type = (int(value) for value in stored)
    return RequestRef(apid, source_id, seq, message_type)


def _task_from(d: dict) -> Task:
    d = dict(d)
    d["request"] = request_ref(d["request"])
    known = Task.__dataclass_fields__
    return Task(**{k: v for k, v in d.items() if k in known})


@dataclass
class JournalDamage:
    """What the reader dropped at open (all zero for a clean journal)."""

    bytes_dropped: int = 0  # inside the journal: damaged records skipped
    records_dropped: int = 0  # damaged regions skipped
    tail_bytes: int = 0  # after the last valid record (a torn append)
    named: list[str] = field(default_factory=list)  # tasks whose state was lost, by name
    unnamed: int = 0  # damaged regions that named no task


@dataclass
class LostTasks:
    """The lost-task registry (queue/lost.rec): tasks the journal lost, most recent first."""

    task_ids: list[str] = field(default_factory=list)
    bytes_dropped: int = 0
    records_dropped: int = 0
    unnamed: int = 0


class TaskQueue:
    def __init__(
        self,
        directory: str,
        fs: DurableFS | None = None,
        *,
        compact_after: int = COMPACT_AFTER,
        results_dir: str | None = None,
        results_budget_bytes: int | None = None,
        on_evict=None,
    ):
        self.fs = fs or DurableFS()
        self.directory = directory
        self.path = os.path.join(directory, "journal.log")
        self.salt_path = os.path.join(directory, "journal.salt")
        self.lost_path = os.path.join(directory, "lost.rec")
        self.ids_path = os.path.join(directory, "ids.log")
        self.compact_after = int(compact_after)
        self._tasks: dict[str, Task] = {}
        self._entries = 0
        self._next_order = 0
        self._lock = threading.RLock()
        self._damage = JournalDamage()
        self._lost = LostTasks()
        results_kwargs = {} if results_budget_bytes is None else {"budget_bytes": results_budget_bytes}
        self.results = ResultStore(
            results_dir or os.path.join(directory, "results"), self.fs, on_evict=on_evict, **results_kwargs
        )
        self._open()

    # ---- journal: reading -----------------------------------------------------------------------
    def _open(self) -> None:
        # Tidying and rewrites wait for a disk that takes them (read-only, full): the queue is read
        # all the same, and a rewrite the open wanted is done by a later open or compaction.
        best_effort(self.fs.makedirs, self.directory)
        best_effort(self.fs.remove_stale_temps, self.directory)
        for name in self.fs.listdir(self.directory):
            if name.endswith(".tmp"):  # temporaries of an older build (fixed names)
                best_effort(self.fs.remove, os.path.join(self.directory, name), False)
        self.salt = salt_file = self._read_salt()
        self._lost = self._read_lost()
        legacy_finished: dict[str, Task] = {}
        mentioned: set[str] = set()
        if self.fs.exists(self.path):
            buf = self.fs.read(self.path)
            for meta in self._scan(buf):
                self._apply(meta, legacy_finished, mentioned)
        ids, ids_complete = self._read_ids()
        mentioned |= ids
        migrated = self._settle(legacy_finished, mentioned)
        if self._damage.records_dropped and not ids_complete:
            # Without an intact copy of the ids, a damaged region may have held a task no one names.
            self._damage.unnamed = max(0, self._damage.records_dropped - len(self._damage.named))
        if salt_file is None:
            # First open, an older build's journal (salt 0) or a damaged salt file: a fresh salt,
            # and the journal rewritten under it below.
            self.salt = secrets.randbits(63) or 1
            best_effort(
                self.fs.write_atomic, self.salt_path, [_SALT.pack(self.salt, zlib.crc32(struct.pack("<Q", self.salt)))]
            )
        if (
            self._damage.bytes_dropped
            or self._damage.tail_bytes
            or migrated
            or salt_file is None
            or self._entries > self.compact_after
        ):
            best_effort(self.compact)  # rewrite clean: the damage is behind us, every live task in its own record
        if self._damage.named or self._damage.records_dropped:
            best_effort(self._remember_lost, self._damage)

    def _read_salt(self) -> int | None:
        if not self.fs.exists(self.salt_path):
            return None
        data = bytes(self.fs.read(self.salt_path))
        if len(data) == _SALT.size:
            salt, crc = _SALT.unpack(data)
            if zlib.crc32(struct.pack("<Q", salt)) == crc:
                return salt
        return None  # damaged: only records reached in sequence are trusted (see _scan)

    def _scan(self, buf) -> list[dict]:
        """Every valid entry in order, skipping damaged records (LevelDB log reader style)."""
        entries, pos, end = [], 0, len(buf)
        while pos < end:
            try:
                rec, n = decode(buf, pos, expect_kind=Kind.QUEUE_ENTRY)
            except RecordError:
                skip, named = self._skip_damaged(buf, pos)
                if skip is None:
                    self._damage.tail_bytes = end - pos  # nothing valid after: a torn tail
                    break
                if skip < 0:  # the last record, complete in length but damaged: not a torn append
                    skip = end - pos
                self._damage.bytes_dropped += skip
                self._damage.records_dropped += 1
                self._damage.named.extend(named)
                pos += skip
                continue
            if self.salt is None:
                self.salt = rec.meta.get("salt")  # no salt file: the journal's own, read in sequence
            entries.append(rec.meta)
            self._entries += 1
            pos += n
        return entries

    def _skip_damaged(self, buf, pos: int) -> tuple[int | None, list[str]]:
        """How many bytes the damaged record at `pos` spans -- None if no valid record follows
        (a torn tail), -1 if it is the last record, whole in length, and damaged -- and the task
        ids its intact header names, if any."""
        named: list[str] = []
        candidates = []
        whole_last = False
        try:
            header = _parse_header(buf, pos)  # header and metadata intact: the length is trustworthy
            named = _task_ids_in(header.meta)
            candidates.append(pos + header.record_len)
            whole_last = pos + header.record_len == len(buf)
        except RecordError:
            pass
        # Else (or if that guess does not land on a record): the next offset where a record that
        # carries this journal's salt verifies. Requiring the salt keeps text that happens to
        # look like a record (a prompt holding record bytes) from being taken for one.
        view = bytes(buf)
        start = pos + 1
        while True:
            for candidate in candidates:
                if candidate < len(view) and self._valid_at(buf, candidate):
                    return candidate - pos, named
            candidates = []
            found = view.find(MAGIC, start)
            if found < 0:
                return (-1, named) if whole_last else (None, named)
            if self._valid_at(buf, found, require_salt=True):
                return found - pos, named
            start = found + 1

    def _valid_at(self, buf, pos: int, require_salt: bool = False) -> bool:
        try:
            rec, _ = decode(buf, pos, expect_kind=Kind.QUEUE_ENTRY)
        except RecordError:
            return False
        if require_salt:
            return self.salt is not None and rec.meta.get("salt") == self.salt
        return True

    def _apply(self, e: dict, legacy_finished: dict[str, Task], mentioned: set[str]) -> None:
        op = e.get("op")
        if op == "snapshot":
            self._tasks = {}
            for t in e.get("tasks", []):  # a snapshot of an older build holds every task inline
                task = _task_from(t)
                (legacy_finished if task.state in FINISHED else self._tasks)[task.task_id] = task
            self._next_order = max(self._next_order, int(e.get("next_order", 0)))
            return
        if op in ("submit", "task"):
            task = _task_from(e["task"])
            self._tasks[task.task_id] = task
            self._next_order = max(self._next_order, task.order + 1)
            return
        task_id = e.get("task_id")
        if op == "reported" and task_id in legacy_finished:
            legacy_finished[task_id].reported = True
            return
        found = self._tasks.get(task_id) if isinstance(task_id, str) else None
        if found is None:
            if isinstance(task_id, str):
                mentioned.add(task_id)  # an entry about a task whose own record was lost
            return
        task, task_id = found, found.task_id  # tasks are filed under their own id
        if op == "priority":
            task.priority = int(e["priority"])
        elif op == "start":
            task.state = RUNNING
            task.starts += 1
        elif op == "finished":
            del self._tasks[task_id]
        # entries of an older build, whose journal kept finished tasks
        elif op == "complete":
            task.state, task.result = COMPLETED, dict(e.get("result", {}))
            legacy_finished[task_id] = self._tasks.pop(task_id)
        elif op in ("fail", "cancel"):
            task.state = FAILED if op == "fail" else CANCELLED
            task.code, task.reason = int(e.get("code", 0)), str(e.get("reason", ""))
            legacy_finished[task_id] = self._tasks.pop(task_id)

    def _settle(self, legacy_finished: dict[str, Task], mentioned: set[str]) -> bool:
        """After reading: move finished tasks of an older journal into the result store, drop
        live entries that the store already holds (a cut between the two writes of a finish),
        and name the tasks that lost their own record. Returns whether anything was migrated."""
        for task in legacy_finished.values():
            if self.results.get(task.task_id) is None:
                self._store_finished(task)
        for task_id in [t for t in self._tasks if self.results.get(t) is not None]:
            del self._tasks[task_id]
        lost = [
            t for t in mentioned if t not in self._tasks and self.results.get(t) is None and t not in legacy_finished
        ]
        self._damage.named = sorted(set(self._damage.named + lost) - set(self._tasks) - set(self.results.index))
        # A result file that does not verify: the task finished, its result is gone.
        for task_id in self.results.damaged:
            if task_id not in self._damage.named:
                self._damage.named.append(task_id)
        self.results.damaged = []
        return bool(legacy_finished)

    def _read_ids(self) -> tuple[set[str], bool]:
        """The task ids of `ids.log` -- every live task's id, in a file of its own, so that a task
        whose journal record is damaged can still be named (a second copy fails independently) --
        and whether that file was read whole."""
        if not self.fs.exists(self.ids_path):
            return set(), False
        buf, pos, ids, whole = self.fs.read(self.ids_path), 0, set(), True
        while pos < len(buf):
            try:
                rec, n = decode(buf, pos, expect_kind=Kind.QUEUE_ENTRY)
                if isinstance(rec.meta.get("task_id"), str):
                    ids.add(rec.meta["task_id"])
                pos += n
            except RecordError:
                whole = False
                found = bytes(buf).find(MAGIC, pos + 1)
                if found < 0:
                    break
                pos = found
        return ids, whole

    # ---- lost tasks ----------------------------------------------------------------------------------
    def _read_lost(self) -> LostTasks:
        if not self.fs.exists(self.lost_path):
            return LostTasks()
        try:
            rec, _ = decode(self.fs.read(self.lost_path), expect_kind=Kind.QUEUE_ENTRY)
            return LostTasks(**rec.meta["lost"])
        except (RecordError, KeyError, TypeError):
            return LostTasks()  # the registry itself damaged: forget the list, keep running

    def _remember_lost(self, damage: JournalDamage) -> None:
        lost = self._lost
        ids = [t for t in damage.named if t not in lost.task_ids] + lost.task_ids
        lost.task_ids = ids[:MAX_LOST_REMEMBERED]
        lost.bytes_dropped += damage.bytes_dropped
        lost.records_dropped += damage.records_dropped
        lost.unnamed += damage.unnamed
        self._write_lost()

    def _write_lost(self) -> None:
        self.fs.write_atomic(self.lost_path, encode(Kind.QUEUE_ENTRY, {"lost": asdict(self._lost)}).chunks)

    def note_lost(self, task_ids: list[str]) -> None:
        """Tasks found lost outside the journal (a checkpoint directory no record explains)."""
        with self._lock:
            fresh = [t for t in task_ids if t not in self._lost.task_ids]
            if fresh:
                self._damage.named = sorted(set(self._damage.named) | set(fresh))
                self._remember_lost(JournalDamage(named=fresh))

    def is_lost(self, task_id: str) -> bool:
        with self._lock:
            return task_id in self._lost.task_ids

    def lost_tasks(self) -> LostTasks:
        """A copy of the lost-task registry (LIST_LOST_TASKS)."""
        with self._lock:
            return replace(self._lost, task_ids=list(self._lost.task_ids))

    def journal_damage(self) -> JournalDamage:
        """A copy of what the reader dropped at open, and the tasks named lost since."""
        with self._lock:
            return replace(self._damage, named=list(self._damage.named))

    def forget_lost(self, task_id: str) -> None:
        """The ground sent a lost task again: it is queued anew (not lost any more)."""
        with self._lock:
            if task_id in self._lost.task_ids:
                self._lost.task_ids.remove(task_id)
                self._write_lost()

    # ---- journal: writing -----------------------------------------------------------------------
    def _encode(self, entry: dict):
        assert self.salt is not None  # _open sets it before anything is written
        return encode(Kind.QUEUE_ENTRY, entry, salt=self.salt).chunks

    def _append(self, entry: dict) -> None:
        with self._lock:
            self.fs.append(self.path, self._encode(entry))
            self._apply(entry, {}, set())
            self._entries += 1
            if self._entries > self.compact_after:
                # The entry is durable: a disk that refuses the rewrite leaves the journal longer,
                # never the change undone (compaction is tried again at the next entry).
                best_effort(self.compact)

    def compact(self) -> None:
        """Replace the journal by one snapshot header and one record per live task (atomic)."""
        with self._lock:
            chunks = self._encode(
                {"op": "snapshot", "next_order": self._next_order, "tasks": [], "live": len(self._tasks)}
            )
            ids = []
            for task in sorted(self._tasks.values(), key=lambda t: t.order):
                chunks += self._encode({"op": "task", "task": asdict(task)})
                ids += self._encode({"task_id": task.task_id})
            # ids.log first: a cut between the two leaves ids of tasks the journal still holds
            self.fs.write_atomic(self.ids_path, ids or [b""])
            self.fs.write_atomic(self.path, chunks)
            self._entries = 1 + len(self._tasks)

    # ---- operations ------------------------------------------------------------------------------
    def submit(
        self,
        task_id: str,
        prompt: str,
        images: list[str],
        max_new_tokens: int,
        priority: int,
        request: RequestRef,
        content_hash: str,
    ) -> Task:
        with self._lock:
            task = Task(
                task_id,
                prompt,
                list(images),
                int(max_new_tokens),
                int(priority),
                request_ref(request),
                content_hash,
                self._next_order,
            )
            self._append({"op": "submit", "task": asdict(task)})
            # The second copy of the id (to name the task should its record be damaged): the
            # task is queued and durable already, so a disk that refuses this costs only that.
            best_effort(self.fs.append, self.ids_path, self._encode({"task_id": task_id}))
            return self._tasks[task_id]

    def set_priority(self, task_id: str, priority: int) -> None:
        self._append({"op": "priority", "task_id": task_id, "priority": int(priority)})

    def start(self, task_id: str) -> None:
        self._append({"op": "start", "task_id": task_id})

    def _finish(self, task_id: str, **final) -> None:
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                return
            done = replace(task, **final)
            self._store_finished(done)  # durable first ...
            self._append({"op": "finished", "task_id": task_id})  # ... then it leaves the journal

    def _store_finished(self, task: Task) -> None:
        record = asdict(task)
        record["reason"] = clip_utf8(str(record.get("reason", "")), MAX_REASON_BYTES)
        if "text" in record.get("result", {}):
            record["result"] = {
                **record["result"],
                "text": clip_utf8(str(record["result"]["text"]), MAX_RESULT_TEXT_BYTES),
            }
        self.results.put(record, reported=task.reported)

    def complete(self, task_id: str, result: dict) -> None:
        self._finish(task_id, state=COMPLETED, result=dict(result))

    def fail(self, task_id: str, code: int, reason: str) -> None:
        self._finish(task_id, state=FAILED, code=int(code), reason=clip_utf8(reason, MAX_REASON_BYTES))

    def cancel(self, task_id: str, reason: str = "cancelled by command", code: int = 0) -> None:
        self._finish(task_id, state=CANCELLED, code=int(code), reason=clip_utf8(reason, MAX_REASON_BYTES))

    def mark_reported(self, task_id: str) -> None:
        with self._lock:
            self.results.mark_reported(task_id)

    def unreported(self) -> list[Task]:
        """Finished tasks whose final report may not have reached the bus."""
        with self._lock:
            out = []
            for task_id in self.results.unreported():
                task = self.get(task_id)
                if task is not None:
                    out.append(task)
            return out

    # ---- queries --------------------------------------------------------------------------------
    def get(self, task_id: str) -> Task | None:
        """A live task, or a finished one with its result (read from the result store); None if
        the task is unknown, evicted or damaged (see `finished`)."""
        with self._lock:
            task = self._tasks.get(task_id)
            if task is not None:
                return task
            record = self.results.load(task_id)
            return None if record is None else _task_from(record)

    def live(self, task_id: str) -> Task | None:
        """A copy of a live (unfinished) task; None if it is finished or unknown."""
        with self._lock:
            task = self._tasks.get(task_id)
            return None if task is None else replace(task)

    def snapshot(self) -> dict[str, Task]:
        """Copies of the live tasks, by id."""
        with self._lock:
            return {task_id: replace(task) for task_id, task in self._tasks.items()}

    def finished(self, task_id: str) -> Finished | None:
        """The result store's entry for a finished task (also for evicted or damaged ones)."""
        return self.results.get(task_id)

    def pending(self) -> list[Task]:
        """Unfinished tasks in run order: an interrupted (running) task first, then by priority
        (higher first), then by arrival."""
        with self._lock:
            waiting = [t for t in self._tasks.values() if t.state in (QUEUED, RUNNING)]
        return sorted(waiting, key=lambda t: (t.state != RUNNING, -t.priority, t.order))

    def depth(self) -> int:
        # Without the lock: the main thread asks (HOUSEKEEPING, STATUS) and must not wait on the
        # journal write the lock is held across; one len() of the dict is one atomic read.
        return len(self._tasks)


def _task_ids_in(meta: dict) -> list[str]:
    """Task ids an (intact) journal entry's metadata names."""
    ids = []
    task = meta.get("task")
    for candidate in (meta.get("task_id"), task.get("task_id") if isinstance(task, dict) else None):
        if isinstance(candidate, str):
            try:
                ids.append(check_name(candidate, "task_id"))
            except Exception:  # a name that is not one: nothing to report
                pass
    for t in meta.get("tasks", []) if isinstance(meta.get("tasks"), list) else []:
        if isinstance(t, dict) and isinstance(t.get("task_id"), str):
            ids.append(t["task_id"])
    return ids


__all__ = [
    "CANCELLED",
    "COMPLETED",
    "DAMAGED",
    "EVICTED",
    "FAILED",
    "FINISHED",
    "QUEUED",
    "RUNNING",
    "Task",
    "TaskQueue",
    "MAX_META",
    "FIXED_HEADER",
    "HEADER_LEN",
]
