"""What the payload reports out about its own life, apart from the answers to commands:

    Faults           an unexpected exception, contained: logged, an event (rate-limited per
                     kind), one count against its item for health and safety
    FinalReports     how each task ended (COMPLETED + TASK_RESULT, or FAILED), once, even across
                     cuts; held back while health and safety waits for the bus's verdict
    Notices          the storage state's changes and the results evicted under the budget
    QuarantineNotice health and safety's events (an abnormal exit, an item quarantined)

Each is handed the outbox and what else it reads; all are called from any of the payload's
threads, and what they keep between calls is behind a lock.
"""

from __future__ import annotations

import shutil
import threading
import time
from typing import Any

from common.wire import EventId, ResponseCode, StorageState
from common.wire import messages as m
from common.wire.errors import clip_reason
from common.wire.ids import MAX_RESULT_TEXT_BYTES, MAX_TIMINGS
from common.wire.text import clip_utf8

from .config import DataPaths
from .handlers import is_task_name
from .health import COMMANDS, MAIN, WORKER, Health, item_task_id, report_item, task_item
from .outbox import Outbox
from .queue import CANCELLED, COMPLETED, TaskQueue
from .results import recovery_fields

#: Fault events of one kind at most this often (a fault that repeats must not flood the link).
FAULT_EVENT_EVERY_S = 5.0

#: The payload's threads by name (app.py starts them): health and safety's slot of each.
WORKER_THREAD = "inference-worker"
COMMAND_THREAD = "command-handler"


def current_slot() -> int:
    """Health and safety's slot of the calling thread (health.py: one item in hand per slot)."""
    name = threading.current_thread().name
    return WORKER if name == WORKER_THREAD else COMMANDS if name == COMMAND_THREAD else MAIN


def event_task_id(item: str | None) -> str | None:
    """The task an item names, when it is one an event's task field may carry."""
    task_id = item_task_id(item) if item else None
    return task_id if task_id and is_task_name(task_id) else None


class Faults:
    """An unexpected exception, contained: logged in full, an event (at most one per kind
    every FAULT_EVENT_EVERY_S), and one count against `item` for health and safety."""

    def __init__(self, outbox: Outbox, health: Health, log: Any):
        self.outbox = outbox
        self.health = health
        self.log = log
        self._lock = threading.Lock()
        self._last_event: dict[EventId, float] = {}

    def fault(self, event_id: EventId, what: str, exc: BaseException, item: str | None = None) -> None:
        reason = f"{what}: {type(exc).__name__}: {exc}"
        self.log.error("fault", event_id=event_id.name, item=item, error=reason, exc_info=exc)
        now = time.monotonic()
        with self._lock:
            due = now - self._last_event.get(event_id, -1e9) >= FAULT_EVENT_EVERY_S
            if due:
                self._last_event[event_id] = now
        if due:
            try:
                self.outbox.event(event_id, reason, event_task_id(item))
            except Exception:  # noqa: BLE001 - the fault report itself must not fail the caller
                self.log.exception("fault_event_failed")
        if item is not None:
            try:
                self.health.fault(item, clip_reason(reason))
            except Exception:  # noqa: BLE001 - e.g. a full disk: counting is best effort
                self.log.exception("fault_count_failed")


def task_result(task: Any) -> m.TaskResult:
    """TASK_RESULT of a completed task, from its stored result."""
    r = task.result
    timings = {k: float(v) for k, v in list(r.get("timings", {}).items())[:MAX_TIMINGS]}
    return m.TaskResult(
        task_id=task.task_id,
        token_ids=list(r["token_ids"]),
        text=clip_utf8(str(r.get("text", "")), MAX_RESULT_TEXT_BYTES),
        logits_sha256=bytes.fromhex(r["logits_sha256"]),
        timings=timings,
        interruptions=task.interruptions,
        **recovery_fields(r),
    )


class FinalReports:
    """COMPLETED (+ TASK_RESULT) or FAILED for a finished task; once it has left, the result
    store records it as reported. A cut before that makes the next boot send it again, so the
    ground always hears how a task ended. A report that cannot be built is a REPORT_FAULT
    (counted by health and safety), never a reason to stop."""

    def __init__(self, outbox: Outbox, queue: TaskQueue, health: Health, faults: Faults):
        self.outbox = outbox
        self.queue = queue
        self.health = health
        self.faults = faults
        self._lock = threading.Lock()
        self._deferred: set[str] = set()  # task ids, sent once the bus says how the last boot ended

    def send(self, task: Any) -> None:
        if task is None:
            return
        item = report_item(task.task_id)
        if self.health.is_quarantined(item):
            return
        if self.health.held(item):
            with self._lock:
                self._deferred.add(task.task_id)
            return
        request = task.request
        mark = lambda: self.queue.mark_reported(task.task_id)  # noqa: E731
        try:
            with self.health.handling(item, current_slot()):
                if task.state == COMPLETED:
                    result = task_result(task)
                    self.outbox.send(m.Completed.about(request, task_id=task.task_id))
                    self.outbox.send(result, on_sent=mark)
                else:
                    code = (
                        ResponseCode.CANCELLED
                        if task.state == CANCELLED
                        else ResponseCode(task.code or ResponseCode.INTERNAL_ERROR)
                    )
                    self.outbox.send(
                        m.Failed.about(
                            request, task_id=task.task_id, code=code, reason=clip_reason(task.reason or task.state)
                        ),
                        on_sent=mark,
                    )
        except Exception as exc:  # noqa: BLE001 - whatever a stored task holds, the payload goes on
            self.faults.fault(EventId.REPORT_FAULT, f"final report of task {task.task_id} failed", exc, item)

    def send_deferred(self) -> None:
        """The reports held back for the bus's verdict, once health and safety suspects nothing
        (command thread)."""
        with self._lock:
            if not self._deferred or self.health.awaiting_verdict():
                return
            deferred, self._deferred = self._deferred, set()
        for task_id in sorted(deferred):
            self.send(self.queue.get(task_id))


class Notices:
    """The storage state's changes (storage.py) and the results the retention budget evicts."""

    def __init__(self, outbox: Outbox, paths: DataPaths, work_available: threading.Event):
        self.outbox = outbox
        self.paths = paths
        self.work_available = work_available

    def storage_changed(self, state: StorageState, previous: StorageState, text: str) -> None:
        event_id = {
            StorageState.FULL: EventId.STORAGE_FULL,
            StorageState.READ_ONLY: EventId.STORAGE_READ_ONLY,
            StorageState.ERROR: EventId.STORAGE_ERROR,
            StorageState.OK: EventId.STORAGE_RESTORED,
        }[state]
        self.outbox.event(event_id, text)
        if state == StorageState.OK:
            self.work_available.set()  # a task held back for the disk may run now

    def result_evicted(self, entry: Any) -> None:
        shutil.rmtree(self.paths.task_dir(entry.task_id), ignore_errors=True)
        self.outbox.event(
            EventId.RESULT_EVICTED,
            f"result of task {entry.task_id} ({entry.state}) removed under the results retention budget",
            entry.task_id if is_task_name(entry.task_id) else None,
        )


class QuarantineNotice:
    """Health and safety's events (health.py `on_event`): an abnormal exit, or an item
    quarantined; a quarantined task's ground is told with a FAILED that carries the code."""

    def __init__(self, outbox: Outbox, queue: TaskQueue):
        self.outbox = outbox
        self.queue = queue

    def __call__(self, kind: str, item: str, text: str) -> None:
        task_id = event_task_id(item)
        if kind == "abnormal_exit":
            self.outbox.event(EventId.ABNORMAL_EXIT, text, task_id)
            return
        self.outbox.event(EventId.ITEM_QUARANTINED, text, task_id)
        if task_id is not None and item == task_item(task_id):
            task = self.queue.live(task_id)
            if task is not None:  # the ground waits on this task: tell it, with the code
                self.outbox.send(
                    m.Failed.about(
                        task.request,
                        task_id=task_id,
                        code=ResponseCode.QUARANTINED,
                        reason=clip_reason(f"task quarantined; RELEASE_QUARANTINE task:{task_id} to run it again"),
                    )
                )


__all__ = [
    "COMMAND_THREAD",
    "FAULT_EVENT_EVERY_S",
    "Faults",
    "FinalReports",
    "Notices",
    "QuarantineNotice",
    "WORKER_THREAD",
    "current_slot",
    "task_result",
]
