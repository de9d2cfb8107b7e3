"""One handler per telecommand (cFS sample_app style: dispatch in dispatch.py, handlers here).

Every handler either accepts -- `accept` counts the command and persists the replay guard and
counters before ACCEPTED leaves -- or raises WireError with the code for the class of problem,
which dispatch turns into REJECTED. PING and STATUS run on the main thread, every other
handler on the command thread (dispatch.py, jobs.py).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.wire import EventId, MessageType, RequestRef, ResponseCode, WireError
from common.wire import messages as m
from common.wire.fields import check_name
from common.wire.ids import MAX_LISTED_ITEMS, MAX_LISTED_TASKS, MAX_REASON_BYTES, is_admin_source
from common.wire.text import clip_utf8
from flight.checkpoint.cadence import Cadence

from .current import CurrentWork
from .health import Health, item_task_id, report_item, task_item
from .images import AwaitedImages, ImageStore, content_hash
from .queue import CANCELLED, COMPLETED, FAILED, FINISHED, TaskQueue
from .results import DAMAGED, EVICTED

MAX_QUEUED = 256


@dataclass(frozen=True)
class PayloadServices:
    """What the handlers use of the process around them (FlightApp's parts', handed in): its
    reports out, the acceptance of a command, a task's result and directory."""

    send: Callable[..., None]  # (message, on_sent=None)
    send_final_report: Callable[[Any], None]  # (task)
    event: Callable[..., None]  # (event_id, text, task_id=None)
    housekeeping: Callable[[], m.Housekeeping]
    forecast_messages: Callable[[], list[m.Message]]
    accept: Callable[..., None]  # (request, **fields): counted, replay guard persisted, ACCEPTED sent
    task_result: Callable[[Any], m.TaskResult]  # (task)
    task_dir: Callable[[str], str]  # (task id)


class CommandHandlers:
    """The telecommand handlers, one object that FlightApp builds and dispatches to
    (`table()`), handed what they use: the queue, images, health and safety, the cadence, what the
    worker is on, the images awaited again, the worker's wake-up, the log and `PayloadServices`."""

    def __init__(
        self,
        *,
        queue: TaskQueue,
        images: ImageStore,
        health: Health,
        cadence: Cadence,
        current: CurrentWork,
        awaited_images: AwaitedImages,
        work_available: threading.Event,
        log: Any,
        services: PayloadServices,
    ):
        self.queue = queue
        self.images = images
        self.health = health
        self.cadence = cadence
        self.current = current
        self.awaited_images = awaited_images
        self.work_available = work_available
        self.log = log
        self.services = services

    def table(self) -> dict:
        """Each telecommand's handler."""
        return {
            MessageType.PING: self.on_ping,
            MessageType.STATUS: self.on_status,
            MessageType.UPLINK_TASK: self.on_uplink_task,
            MessageType.CANCEL_TASK: self.on_cancel_task,
            MessageType.SET_PRIORITY: self.on_set_priority,
            MessageType.DOWNLINK_RESULT: self.on_downlink_result,
            MessageType.IMAGE_CHUNK: self.on_image_chunk,
            MessageType.IMAGE_QUERY: self.on_image_query,
            MessageType.LIST_QUARANTINE: self.on_list_quarantine,
            MessageType.RELEASE_QUARANTINE: self.on_release_quarantine,
            MessageType.LIST_LOST_TASKS: self.on_list_lost_tasks,
            MessageType.SHUTDOWN_WARNING: self.on_shutdown_warning,
            MessageType.POWER_STATE: self.on_power_state,
            MessageType.THERMAL: self.on_thermal_report,
            MessageType.POWER: self.on_power_report,
        }

    # ---- simple commands ---------------------------------------------------------------------------
    def on_ping(self, request, msg: m.Ping) -> None:
        self.services.accept(request)
        self.services.send(m.Pong(key=msg.key))
        self.services.send(m.Completed.about(request))

    def on_status(self, request, msg) -> None:
        self.services.accept(request)
        for message in self.services.forecast_messages():  # the ground's completion forecast's inputs
            self.services.send(message)
        self.services.send(self.services.housekeeping())
        self.services.send(m.Completed.about(request))

    # ---- tasks -------------------------------------------------------------------------------------------
    def on_uplink_task(self, request, msg: m.UplinkTask) -> None:
        digest = content_hash(msg.prompt, list(msg.images), msg.max_new_tokens)
        live = self.queue.live(msg.task_id)
        finished = self.queue.finished(msg.task_id)
        if live is not None or finished is not None:
            # Another station's task id: not its to resend, nor to learn the content of.
            _refuse_foreign(request, _owner_of(self.queue, msg.task_id), msg.task_id)
            if finished is not None and finished.gone == DAMAGED:
                raise WireError(
                    ResponseCode.TASK_LOST,
                    f"task {msg.task_id} finished but its record on board is "
                    "damaged; it is not run again (uplink it under a new id)",
                )
            if live is not None:
                known = live.content_hash
            else:
                assert finished is not None  # one of the two, by the test above
                known = finished.content_hash
            if known != digest:
                raise WireError(ResponseCode.DUPLICATE_TASK, f"task {msg.task_id} exists with other content")
            self.services.accept(request, task_id=msg.task_id)  # the same uplink again: idempotent
            return
        if self.queue.depth() >= MAX_QUEUED:
            raise WireError(ResponseCode.QUEUE_FULL, f"{MAX_QUEUED} tasks queued")
        relost = self.queue.is_lost(msg.task_id)
        self.queue.submit(
            msg.task_id,
            msg.prompt,
            list(msg.images),
            msg.max_new_tokens,
            msg.priority,
            request,
            digest,
        )
        self.services.accept(request, task_id=msg.task_id)
        if relost:
            # It never finished (the result store would know), so this is not a second run: it
            # resumes from whatever checkpoints it had. Said out loud all the same.
            self.queue.forget_lost(msg.task_id)
            self.services.event(
                EventId.TASKS_LOST,
                f"task {msg.task_id}, lost to journal damage, queued again as the ground sent it again",
                msg.task_id,
            )
        self.services.event(EventId.TASK_QUEUED, f"task {msg.task_id} queued (priority {msg.priority})", msg.task_id)
        self.services.send(self.services.housekeeping())
        self.work_available.set()

    def _unknown_or_gone(self, task_id: str) -> WireError:
        finished = self.queue.finished(task_id)
        if finished is not None and finished.gone == EVICTED:
            return WireError(
                ResponseCode.RESULT_EVICTED,
                f"task {task_id} finished ({finished.state}); its result was "
                "removed under the results retention budget",
            )
        if (finished is not None and finished.gone == DAMAGED) or self.queue.is_lost(task_id):
            return WireError(ResponseCode.TASK_LOST, f"task {task_id}: its state on board was lost to storage damage")
        if finished is not None:
            return WireError(ResponseCode.TASK_FINISHED, f"task {task_id} is {finished.state}")
        return WireError(ResponseCode.UNKNOWN_TASK, f"no task {task_id}")

    def _unfinished_task(self, task_id: str):
        task = self.queue.live(task_id)
        if task is None:
            error = self._unknown_or_gone(task_id)
            if error.code == ResponseCode.RESULT_EVICTED:
                error = WireError(ResponseCode.TASK_FINISHED, error.reason)
            raise error
        return task

    def on_cancel_task(self, request, msg: m.CancelTask) -> None:
        _refuse_foreign(request, _owner_of(self.queue, msg.task_id), msg.task_id)
        task = self._unfinished_task(msg.task_id)
        self.services.accept(request, task_id=msg.task_id)
        if not self.current.cancel(msg.task_id):  # the running one ends at its next unit boundary
            self.finish_cancel(task)
        self.services.send(m.Completed.about(request, task_id=msg.task_id))

    def finish_cancel(self, task) -> None:
        self.queue.cancel(task.task_id, code=int(ResponseCode.CANCELLED))
        self.health.release(task_item(task.task_id))  # a cancelled task is no longer held back
        self.services.send_final_report(self.queue.get(task.task_id))
        self.services.event(EventId.TASK_CANCELLED, f"task {task.task_id} cancelled", task.task_id)
        shutil.rmtree(self.services.task_dir(task.task_id), ignore_errors=True)

    def on_set_priority(self, request, msg: m.SetPriority) -> None:
        _refuse_foreign(request, _owner_of(self.queue, msg.task_id), msg.task_id)
        self._unfinished_task(msg.task_id)
        self.queue.set_priority(msg.task_id, msg.priority)
        self.services.accept(request, task_id=msg.task_id)
        self.services.send(m.Completed.about(request, task_id=msg.task_id))

    def on_downlink_result(self, request, msg: m.DownlinkResult) -> None:
        _refuse_foreign(request, _owner_of(self.queue, msg.task_id), msg.task_id)
        live = self.queue.live(msg.task_id)
        if live is not None:
            if self.health.is_quarantined(task_item(msg.task_id)):
                raise WireError(
                    ResponseCode.QUARANTINED,
                    f"task {msg.task_id} is quarantined (RELEASE_QUARANTINE {task_item(msg.task_id)} to run it again)",
                )
            corrupt = self.awaited_images.get(msg.task_id)
            if corrupt:
                raise WireError(
                    ResponseCode.IMAGE_CORRUPT,
                    f"task {msg.task_id} waits for image {corrupt}, found damaged on board: send it again",
                )
            raise WireError(ResponseCode.RESULT_NOT_READY, f"task {msg.task_id} is {live.state}")
        task = self.queue.get(msg.task_id)
        if task is None:
            raise self._unknown_or_gone(msg.task_id)
        if task.state in (FAILED, CANCELLED):
            # Finished without a result: say why, so a waiting ground stops waiting.
            code = (
                ResponseCode.CANCELLED
                if task.state == CANCELLED
                else ResponseCode(task.code or ResponseCode.TASK_FINISHED)
            )
            raise WireError(code, f"task {msg.task_id} {task.state}: {task.reason}")
        self.services.accept(request, task_id=msg.task_id)
        self.services.send(self.services.task_result(task))
        self.services.send(m.Completed.about(request, task_id=msg.task_id))

    # ---- images ------------------------------------------------------------------------------------
    def on_image_chunk(self, request, msg: m.ImageChunk) -> None:
        try:
            completed = self.images.put_chunk(msg)
        except WireError as err:
            self._image_rejected(msg.image, err)
            raise
        self.services.accept(request)
        if completed:
            self._image_verified(msg.image, msg.image_size)

    def on_image_query(self, request, msg: m.ImageQuery) -> None:
        self.services.accept(request)
        # A cut between the last chunk and the file's commit leaves every chunk held: nothing new
        # will arrive, so the query finishes the verification, with the events a chunk would give.
        try:
            size = self.images.complete_held(msg.image)
        except WireError as err:
            self._image_rejected(msg.image, err)  # dropped: the status says so, the ground sends it again
        else:
            if size is not None:
                self._image_verified(msg.image, size)
        self.services.send(self.images.status(msg.image))
        self.services.send(m.Completed.about(request))

    def _image_verified(self, name: str, size: int) -> None:
        self.services.event(EventId.IMAGE_COMPLETE, f"image {name} verified ({size} bytes)")
        self.work_available.set()

    def _image_rejected(self, name: str, err: WireError) -> None:
        if err.code in (
            ResponseCode.FILE_HASH_MISMATCH,
            ResponseCode.IMAGE_UNDECODABLE,
            ResponseCode.IMAGE_TOO_LARGE,
            ResponseCode.IMAGE_SHAPE_UNSUPPORTED,
        ):
            self.services.event(EventId.IMAGE_REJECTED, f"image {name}: {err.reason}")

    # ---- health and safety, journal integrity ------------------------------------------------------------
    def on_list_quarantine(self, request, msg) -> None:
        listing = self.health.listing()
        shown = listing[:MAX_LISTED_ITEMS]
        self.services.accept(request)
        self.services.send(
            m.QuarantineList(
                items=[i for i, _, _ in shown],
                exits=[n for _, n, _ in shown],
                reasons=[clip_utf8(r, MAX_REASON_BYTES) for _, _, r in shown],
                total=len(listing),
            )
        )
        self.services.send(m.Completed.about(request))

    def on_release_quarantine(self, request, msg: m.ReleaseQuarantine) -> None:
        # A station may release its own task's items; commands and the engine are the
        # operations centre's (an admin source) to release.
        owned_task = item_task_id(msg.item)
        if owned_task is None and not is_admin_source(request.source_id):
            raise WireError(
                ResponseCode.NOT_OWNER,
                f"{msg.item} is not a task's: only an admin station (source 0x0001..0x000F) may release it",
            )
        if owned_task is not None:
            _refuse_foreign(request, _owner_of(self.queue, owned_task), owned_task)
        if not self.health.release(msg.item):
            raise WireError(ResponseCode.NOT_QUARANTINED, f"{msg.item} is not quarantined")
        task_id = item_task_id(msg.item)
        self.services.accept(request, task_id=task_id if task_id and is_task_name(task_id) else None)
        self.services.event(
            EventId.QUARANTINE_RELEASED,
            f"{msg.item} released from quarantine by command",
            task_id if task_id and is_task_name(task_id) else None,
        )
        if msg.item.startswith("task:"):
            self.work_available.set()
        elif msg.item.startswith("report:") and task_id:
            task = self.queue.get(task_id)
            if task is not None and task.state in FINISHED:
                self.services.send_final_report(task)
        self.services.send(m.Completed.about(request))

    def on_list_lost_tasks(self, request, msg) -> None:
        lost = self.queue.lost_tasks()
        self.services.accept(request)
        self.services.send(
            m.LostTasks(
                task_ids=lost.task_ids[:MAX_LISTED_TASKS],
                total=len(lost.task_ids),
                bytes_dropped=lost.bytes_dropped,
                records_dropped=lost.records_dropped,
                unnamed=lost.unnamed,
            )
        )
        self.services.send(m.Completed.about(request))

    # ---- from the bus --------------------------------------------------------------------------------
    def on_shutdown_warning(self, header, msg: m.ShutdownWarning) -> None:
        text = f"bus warns of a cut in {msg.lead_time_s:.1f} s ({msg.cause})"
        self.services.event(EventId.SHUTDOWN_WARNING_RECEIVED, text)
        self.cadence.warning(msg.lead_time_s)
        engine = self.current.engine()
        if engine is not None:
            engine.checkpoint_soon.set()

    def on_power_state(self, header, msg: m.PowerStateChange) -> None:
        self.log.info("power_state", **{k: str(v) for k, v in msg.pack().items()})
        if msg.payload_on and msg.after_fault is not None:
            self.health.verdict(msg.after_fault)  # how the previous boot ended, in the bus's words
            self.work_available.set()

    def on_thermal_report(self, header, msg: m.ThermalReport) -> None:
        self.cadence.thermal(msg.trace_time_s, msg.payload_temp_c)  # the adaptive cadence's temperature trend

    def on_power_report(self, header, msg: m.PowerReport) -> None:
        self.cadence.power(msg.trace_time_s, msg.battery_soc)  # the adaptive cadence's battery trend


def is_task_name(value: str) -> bool:
    """Whether `value` is a valid task id (what an event's task field may carry)."""
    try:
        check_name(value, "task_id")
        return True
    except WireError:
        return False


def _owner_of(queue: TaskQueue, task_id: str) -> int | None:
    """The source id that uplinked the task (its stored request), or None when the payload no
    longer knows it (unknown, or a finished task whose record was evicted or damaged)."""
    task = queue.get(task_id)
    return None if task is None else task.request.source_id


def _refuse_foreign(request: RequestRef, owner: int | None, task_id: str) -> None:
    """Station isolation (docs/flight.md "Commands"): a station (source 0x0010..0x00FF) acts on
    the tasks it uplinked only; an admin station (0x0001..0x000F) on every task."""
    if owner is None or owner == request.source_id or is_admin_source(request.source_id):
        return
    raise WireError(
        ResponseCode.NOT_OWNER,
        f"task {task_id} belongs to another station; source {request.source_id:#06x} may act only on its own tasks",
    )


__all__ = ["COMPLETED", "CommandHandlers", "MAX_QUEUED", "report_item"]
