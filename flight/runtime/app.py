"""The onboard process: command dispatch, the inference worker, telemetry.

    main thread    the payload link (ZeroMQ DEALER to the bus): receive telecommands, decode,
                   replay-check, dispatch to one handler per opcode (handlers.py; cFS style: every
                   handler bumps the command or the error counter), send reports, heartbeat,
                   housekeeping
    worker thread  takes the next task from the persistent queue and runs the resumable engine;
                   its progress becomes PUS-1 PROGRESS reports

Everything that must survive a power cut is on disk before it is acknowledged: the replay guard
and counters (state/), the queue journal (queue/), finished tasks (results/), image chunks
(images/), each task's checkpoints (tasks/<id>/), health and safety (health/). On boot the
interrupted task resumes first.

Nothing a command, a stored task or a report holds may stop the process: the main loop, each
handler, the worker and each report catch whatever they raise, report it with an event of its
own and carry on; health.py counts such faults and the boots that ended while an item was being
handled, and quarantines an item that keeps killing the payload.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from common import log as owlog
from common.durable import DurableFS, best_effort, storage_condition, write_watch
from common.imagecheck import ProcessorLimits
from common.record import Kind, RecordError, decode, encode
from common.wire import (
    Apid,
    EventId,
    MessageType,
    NodeId,
    ReplayError,
    ReplayGuard,
    RequestRef,
    ResponseCode,
    StorageState,
    TaskPhase,
    WireError,
)
from common.wire import decode as decode_packet
from common.wire import encode as encode_packet
from common.wire import (
    messages as m,
)
from common.wire.errors import clip_reason
from common.wire.ids import MAX_EVENT_TEXT_BYTES, MAX_RESULT_TEXT_BYTES, MAX_TIMINGS
from common.wire.link import KeyLayout, LinkError, client_socket, recv_packet, send_packet
from common.wire.seq import AheadSequenceCounter
from common.wire.text import clip_utf8
from flight.checkpoint.cadence import Cadence, WindowLog, WriteCosts
from flight.events import UNIT_DONE, EngineEvent, RunStatus, StopToken
from flight.model.config import processors_hash
from flight.options import EngineOptions, resolve_cadence

from .current import CurrentWork
from .handlers import MAX_QUEUED, CommandHandlers, PayloadServices, is_task_name  # noqa: F401  (MAX_QUEUED: re-exported)
from .health import COMMANDS, ENGINE_ITEM, MAIN, WORKER, Health, command_item, item_task_id, report_item, task_item
from .images import AwaitedImages, ImageCorrupt, ImageStore
from .profile import WorkProfile, append_start
from .queue import CANCELLED, COMPLETED, RUNNING, TaskQueue
from .storage import DEFAULT_RESERVE_BYTES, GatedFS, Storage

HEARTBEAT_S = 1.0
HOUSEKEEPING_S = 5.0
#: How long the command thread holds the boot's WINDOW_HISTORY for the main thread's first
#: HEARTBEAT (queued microseconds after the command thread starts).
HEARTBEAT_FIRST_WAIT_S = 5.0
#: Fault events of one kind at most this often (a fault that repeats must not flood the link).
FAULT_EVENT_EVERY_S = 5.0
#: Pause after an unexpected fault in a loop, so a fault that repeats cannot spin the CPU.
FAULT_BACKOFF_S = 0.5
#: Pause between attempts to load the engine when it fails.
ENGINE_RETRY_S = 10.0
#: A durable write running this long is reported as a stall (STORAGE_STALL) ...
STALL_REPORT_S = 2.0
#: ... at most this often.
STALL_EVENT_EVERY_S = 30.0
#: The command thread's housekeeping (health expiry, deferred reports, the storage check, saving
#: a dirty state, the telemetry reservation) runs this often when no command keeps it busy.
TICK_S = 0.5
#: Bytes held in checkpoints are counted again this often (a walk of tasks/).
CHECKPOINT_COUNT_EVERY_S = 5.0
#: Telecommands that change what is stored: refused while the disk takes no writes.
STATE_CHANGING = {
    MessageType.UPLINK_TASK,
    MessageType.IMAGE_CHUNK,
    MessageType.CANCEL_TASK,
    MessageType.SET_PRIORITY,
    MessageType.RELEASE_QUARANTINE,
}
#: Telecommands answered on the main thread, from memory: the answers that must never wait on
#: the disk (the bus's and the ground's proof of life).
ANSWERED_AT_ONCE = {MessageType.PING, MessageType.STATUS}
#: Telecommands whose acceptance needs no durable write first: they change nothing a replay
#: could repeat harmfully (the replay guard is saved with the next write).
QUERIES = ANSWERED_AT_ONCE | {
    MessageType.DOWNLINK_RESULT,
    MessageType.IMAGE_QUERY,
    MessageType.LIST_QUARANTINE,
    MessageType.LIST_LOST_TASKS,
}
STORAGE_CODES = {
    StorageState.FULL: ResponseCode.STORAGE_FULL,
    StorageState.READ_ONLY: ResponseCode.STORAGE_READ_ONLY,
    StorageState.ERROR: ResponseCode.STORAGE_ERROR,
}
#: How often a missing or unreadable model directory is looked for again.
MODEL_RECHECK_S = 2.0
#: On a stop (SIGTERM, SIGINT), how long the process waits for the worker to reach the end of its
#: unit of work (where the engine looks at the task's StopToken, which `self.stop` pauses). A unit
#: takes well under this on the target; a weight load may not (then see `worker_busy`).
STOP_WAIT_S = 30.0
#: The wire's phase of each unit of work (flight/events.py UNIT_DONE).
UNIT_EVENTS = {
    EngineEvent.VISION_BLOCK_DONE: TaskPhase.VISION,
    EngineEvent.PREFILL_BLOCK_DONE: TaskPhase.PREFILL,
    EngineEvent.DECODE_STEP_DONE: TaskPhase.DECODE,
}
assert set(UNIT_EVENTS) == UNIT_DONE


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_memory_bytes() -> int | None:
    """This process's resident memory now (HOUSEKEEPING `memory_rss_bytes`): the second field of
    /proc/self/statm, in pages. One small read from procfs, never the disk. None off Linux."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Counters:
    boot_count: int = 0
    command_count: int = 0
    error_count: int = 0


class PersistentState:
    """Boot count, command/error counters and the replay guard, in one record (atomic replace).

    Changed by the main thread (the guard, as each telecommand arrives) and the command thread;
    `save()` writes a consistent copy and may be called from any thread but the main one, which
    never waits on the disk: a change that is not saved at once is `dirty` until the command
    thread's next save."""

    def __init__(self, directory: str, fs: DurableFS):
        self.fs, self.path = fs, os.path.join(directory, "state.rec")
        self.lock = threading.RLock()
        self.dirty = False
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

    def save(self) -> None:
        with self.lock:
            meta = {"counters": dict(self.counters.__dict__), "guard": self.guard.to_bytes()}
            self.dirty = False
        try:
            self.fs.write_atomic(self.path, encode(Kind.GUARD_STATE, meta).chunks)
        except BaseException:
            self.dirty = True
            raise


class ImagesAwaited(Exception):
    """A running task needs an image that was found damaged (and removed): it waits for the
    ground to send it again (IMAGE_CORRUPT), as a task that has not started does."""


class FlightApp:
    def __init__(
        self,
        data_dir: str,
        model_dir: str,
        keys_dir: str,
        endpoint: str,
        engine_options,
        device: str | None = None,
        dtype: str | None = None,
        fs: DurableFS | None = None,
        checkpoint_fs: DurableFS | None = None,
        weight_read_hook=None,
        results_budget_bytes: int | None = None,
        compact_after: int | None = None,
        cadence=None,
        storage_reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ):
        self.fs = fs or DurableFS()
        self.data_dir = os.path.abspath(data_dir)
        self.model_dir = model_dir
        self.endpoint = endpoint
        self.layout = KeyLayout(Path(keys_dir))
        self.options = engine_options
        self.device, self.dtype = device, dtype
        self.weight_read_hook = weight_read_hook
        self.log = owlog.get(component="flight")
        self.outbox: queue.Queue = queue.Queue()
        # Jobs for the command thread: every handler that writes, and every write the main
        # thread would otherwise wait on (Threads, docs/flight.md).
        self.jobs: queue.Queue = queue.Queue()
        self._command_thread: threading.Thread | None = None
        self.started = time.monotonic()
        self.current = CurrentWork()  # the worker writes it; the main and command threads read it
        self.stop = threading.Event()
        self.work_available = threading.Event()
        self._worker_thread: threading.Thread | None = None
        self.awaited_images = AwaitedImages()  # task id -> image found damaged, waiting to be sent again
        self.engine: Any = None  # the Engine the worker runs now (typed loosely: it imports torch)
        self._last_fault_event: dict[EventId, float] = {}
        # The data disk as an environment condition (storage.py): its state decides what is
        # refused; a write failing with ENOSPC, EROFS or EIO moves it, and is never a task's fault.
        self.storage = Storage(
            self.data_dir, self.fs, storage_reserve_bytes, on_change=self._storage_changed, log=self.log
        )
        # The engine's checkpoint records: the same disk, but a target-emulating testbench
        # charges them apart from the process's own data (flight/cli_options.data_storage_for),
        # and while the disk is degraded they are refused before they reach it.
        self.checkpoint_fs = GatedFS(checkpoint_fs or self.fs, self.storage)
        # The same gate for the payload's other growth on its own disk (a task's stored inputs).
        self.growth_fs = GatedFS(self.fs, self.storage)
        self.state = PersistentState(os.path.join(self.data_dir, "state"), self.fs)
        self.tm_counter = self._telemetry_counter()
        queue_options = {} if compact_after is None else {"compact_after": compact_after}
        self.queue = TaskQueue(
            os.path.join(self.data_dir, "queue"),
            self.fs,
            results_dir=os.path.join(self.data_dir, "results"),
            results_budget_bytes=results_budget_bytes,
            on_evict=self._on_evict,
            **queue_options,
        )
        self.images = ImageStore(
            os.path.join(self.data_dir, "images"), self.fs, ProcessorLimits.of_model_dir(model_dir)
        )
        self.health = Health(
            os.path.join(self.data_dir, "health"),
            self.fs,
            boot=self.state.counters.boot_count + 1,
            on_event=self._health_event,
            log=self.log,
        )
        self._name_orphaned_tasks()
        self.storage.open()
        self._deferred_reports: set[str] = set()
        # What HOUSEKEEPING reports without touching the disk on the main thread (refreshed by
        # the command thread): bytes held in checkpoints.
        self._checkpoint_bytes_seen = 0
        self._stall_reported_at = -1e9
        self._disk_full_reported_at = -1e9
        # Checkpoint cadence: fed with warnings, bus telemetry and the windows lived through
        # (flight/checkpoint/cadence.py); shared by every task of this boot. Options that name no
        # cadence get their policy's default (flight/options.py), as the engine's own would.
        named = engine_options if engine_options is not None else EngineOptions()
        self.cadence = cadence or Cadence(resolve_cadence(named.policy, named.cadence))
        self.cadence.started = self.started  # uptime counts from here, as the window log's does
        try:
            self.windows: WindowLog | None = WindowLog(os.path.join(self.data_dir, "state"), started=self.started)
        except OSError as exc:  # advice only (the adaptive cadence): never a reason not to boot
            self.log.warning("window_log_unavailable", error=str(exc))
            self.windows = None
        # What this payload measures of its own work, downlinked for the ground's completion
        # forecast (PAYLOAD_PROFILE, WINDOW_HISTORY; flight/runtime/profile.py).
        self.profile = WorkProfile(os.path.join(self.data_dir, "state", "profile.json"))
        self._heartbeat_queued = threading.Event()  # the boot's HEARTBEAT goes before anything else
        self._window_history: m.WindowHistory | None = None  # this boot's, sent again with each STATUS
        # The telecommand handlers: one object, handed what they use (handlers.py).
        self.commands = CommandHandlers(
            queue=self.queue,
            images=self.images,
            health=self.health,
            cadence=self.cadence,
            current=self.current,
            awaited_images=self.awaited_images,
            work_available=self.work_available,
            log=self.log,
            services=PayloadServices(
                send=self.send,
                send_final_report=self.send_final_report,
                event=self.event,
                housekeeping=self.housekeeping,
                forecast_messages=self.forecast_messages,
                accept=self._accept,
                task_result=self._task_result,
                task_dir=self._task_dir,
                running_engine=lambda: self.engine,
            ),
        )
        self.handlers = self.commands.table()

    def _telemetry_counter(self) -> AheadSequenceCounter:
        counter = AheadSequenceCounter(os.path.join(self.data_dir, "state", "tm-sequence.bin"), fs=self.fs)
        if counter.reset_reason is not None:
            self.log.warning("telemetry_counter_reset", error=counter.reset_reason)
        return counter

    # ---- outbound ------------------------------------------------------------------------------
    def send(self, message: m.Message, on_sent=None) -> None:
        """Queue a telemetry packet (thread-safe; the main thread sends). `on_sent` runs once the
        packet has left for the bus."""
        packet = encode_packet(message, Apid.PAYLOAD, self.tm_counter.next(Apid.PAYLOAD), source_id=NodeId.PAYLOAD)
        self.outbox.put((packet, on_sent))

    def send_final_report(self, task) -> None:
        """COMPLETED (+ TASK_RESULT) or FAILED for a finished task; once it has left, the result
        store records it as reported. A cut before that makes the next boot send it again, so the
        ground always hears how a task ended. A report that cannot be built is a REPORT_FAULT
        (counted by health and safety), never a reason to stop."""
        if task is None:
            return
        item = report_item(task.task_id)
        if self.health.is_quarantined(item):
            return
        if self.health.held(item):
            self._deferred_reports.add(task.task_id)  # sent once the bus says how the last boot ended
            return
        request = task.request
        mark = lambda: self.queue.mark_reported(task.task_id)  # noqa: E731
        try:
            with self.health.handling(item, self._slot()):
                if task.state == COMPLETED:
                    result = self._task_result(task)
                    self.send(m.Completed.about(request, task_id=task.task_id))
                    self.send(result, on_sent=mark)
                else:
                    code = (
                        ResponseCode.CANCELLED
                        if task.state == CANCELLED
                        else ResponseCode(task.code or ResponseCode.INTERNAL_ERROR)
                    )
                    self.send(
                        m.Failed.about(
                            request, task_id=task.task_id, code=code, reason=clip_reason(task.reason or task.state)
                        ),
                        on_sent=mark,
                    )
        except Exception as exc:  # noqa: BLE001 - whatever a stored task holds, the payload goes on
            self._fault(EventId.REPORT_FAULT, f"final report of task {task.task_id} failed", exc, item)

    def _task_result(self, task) -> m.TaskResult:
        r = task.result
        timings = {k: float(v) for k, v in list(r.get("timings", {}).items())[:MAX_TIMINGS]}
        return m.TaskResult(
            task_id=task.task_id,
            token_ids=list(r["token_ids"]),
            text=clip_utf8(str(r.get("text", "")), MAX_RESULT_TEXT_BYTES),
            logits_sha256=bytes.fromhex(r["logits_sha256"]),
            timings=timings,
            interruptions=task.interruptions,
        )

    def event(self, event_id: EventId, text: str, task_id: str | None = None) -> None:
        text = clip_utf8(text, MAX_EVENT_TEXT_BYTES)
        self.log.info("event", event_id=event_id.name, text=text, task_id=task_id)
        self.send(m.Event(event_id=event_id, text=text, task_id=task_id))

    def _fault(self, event_id: EventId, what: str, exc: BaseException, item: str | None = None) -> None:
        """An unexpected exception, contained: logged in full, an event (at most one per kind
        every FAULT_EVENT_EVERY_S), and one count against `item` for health and safety."""
        reason = f"{what}: {type(exc).__name__}: {exc}"
        self.log.error("fault", event_id=event_id.name, item=item, error=reason, exc_info=exc)
        now = time.monotonic()
        if now - self._last_fault_event.get(event_id, -1e9) >= FAULT_EVENT_EVERY_S:
            self._last_fault_event[event_id] = now
            try:
                task_id = item_task_id(item) if item else None
                self.event(event_id, reason, task_id if task_id and is_task_name(task_id) else None)
            except Exception:  # noqa: BLE001 - the fault report itself must not fail the caller
                self.log.exception("fault_event_failed")
        if item is not None:
            try:
                self.health.fault(item, clip_reason(reason))
            except Exception:  # noqa: BLE001 - e.g. a full disk: counting is best effort
                self.log.exception("fault_count_failed")

    def _slot(self) -> int:
        name = threading.current_thread().name
        return WORKER if name == "inference-worker" else COMMANDS if name == "command-handler" else MAIN

    def housekeeping(self) -> m.Housekeeping:
        """From memory: the main thread sends it and never waits on the disk (the checkpoint
        bytes are counted by the command thread; the free space is one statvfs; the resident
        memory one procfs read; the bytes written a counter of the durable file layer)."""
        c = self.state.counters
        storage = self.storage
        now = self.current.snapshot()
        return m.Housekeeping(
            queue_depth=self.queue.depth(),
            current_task=now.task,
            phase=now.phase,
            progress_done=now.done,
            progress_total=now.total,
            checkpoint_bytes=self._checkpoint_bytes_seen,
            disk_free_bytes=max(0, self.fs.free_bytes(self.data_dir)),
            boot_count=c.boot_count,
            command_count=c.command_count,
            error_count=c.error_count,
            uptime_s=time.monotonic() - self.started,
            storage_state=storage.state,
            longest_write_s=round(write_watch.longest_since_reset(reset=True), 3),
            reserve_bytes=storage.reserve_held,
            memory_rss_bytes=resident_memory_bytes(),
            written_bytes=write_watch.written(),
        )

    def _checkpoint_bytes(self) -> int:
        root = os.path.join(self.data_dir, "tasks")
        total = 0
        for d, _, files in os.walk(root):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(d, f))
                except OSError:
                    pass
        return total

    # ---- storage as an environment condition (storage.py) ---------------------------------------
    def _storage_changed(self, state: StorageState, previous: StorageState, text: str) -> None:
        event_id = {
            StorageState.FULL: EventId.STORAGE_FULL,
            StorageState.READ_ONLY: EventId.STORAGE_READ_ONLY,
            StorageState.ERROR: EventId.STORAGE_ERROR,
            StorageState.OK: EventId.STORAGE_RESTORED,
        }[state]
        self.event(event_id, text)
        if state == StorageState.OK:
            self.work_available.set()  # a task held back for the disk may run now

    def _storage_refusal(self, message: m.Message) -> WireError | None:
        """Why a telecommand that needs the disk is refused now, without trying it (None: try).
        A full disk refuses what would grow it (a new task, an image chunk); a read-only or
        failing one refuses every command that changes state."""
        growth = isinstance(message, m.ImageChunk) or (
            isinstance(message, m.UplinkTask)
            and message.task_id not in self.queue.tasks
            and self.queue.finished(message.task_id) is None
        )
        if not growth and message.TYPE not in STATE_CHANGING:
            return None
        code = self.storage.refusal_errno(growth)
        if code is None:
            return None
        response = STORAGE_CODES[self.storage.state]
        return WireError(
            response,
            f"payload storage is {self.storage.state.value}: {message.TYPE.name} refused until it "
            f"can be written again ({self.storage.reason})",
        )

    def _storage_failed(self, exc: BaseException, what: str) -> bool:
        """A storage condition met by a write (then reported through the storage state, and True);
        False for any other exception."""
        return self.storage.failed(exc, what)

    def _watch_stall(self, now: float) -> None:
        """A durable write that has run for STALL_REPORT_S is reported (at most every
        STALL_EVENT_EVERY_S): the payload is waiting on its disk, not hung."""
        running = write_watch.running_for()
        if running >= STALL_REPORT_S and now - self._stall_reported_at >= STALL_EVENT_EVERY_S:
            self._stall_reported_at = now
            self.event(
                EventId.STORAGE_STALL,
                f"a durable write has been waiting on the data disk for {running:.1f} s; commands that "
                "change state are answered once it completes, PING, STATUS and heartbeats go on",
            )

    # ---- health and safety hooks ------------------------------------------------------------------
    def _health_event(self, kind: str, item: str, text: str) -> None:
        task_id = item_task_id(item)
        task_id = task_id if task_id and is_task_name(task_id) else None
        if kind == "abnormal_exit":
            self.event(EventId.ABNORMAL_EXIT, text, task_id)
            return
        self.event(EventId.ITEM_QUARANTINED, text, task_id)
        if task_id is not None and item == task_item(task_id):
            task = self.queue.tasks.get(task_id)
            if task is not None:  # the ground waits on this task: tell it, with the code
                self.send(
                    m.Failed.about(
                        task.request,
                        task_id=task_id,
                        code=ResponseCode.QUARANTINED,
                        reason=clip_reason(f"task quarantined; RELEASE_QUARANTINE task:{task_id} to run it again"),
                    )
                )

    def _on_evict(self, entry) -> None:
        shutil.rmtree(self._task_dir(entry.task_id), ignore_errors=True)
        self.event(
            EventId.RESULT_EVICTED,
            f"result of task {entry.task_id} ({entry.state}) removed under the results retention budget",
            entry.task_id if is_task_name(entry.task_id) else None,
        )

    def _name_orphaned_tasks(self) -> None:
        """A task directory whose task neither the journal nor the result store knows belongs
        to a task the journal lost: name it. One whose task finished is garbage."""
        root = os.path.join(self.data_dir, "tasks")
        orphans = []
        for name in self.fs.listdir(root):
            if name in self.queue.tasks:
                continue
            if self.queue.finished(name) is not None:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            elif not self.queue.is_lost(name):
                orphans.append(name)
        if orphans:
            best_effort(self.queue.note_lost, orphans)  # named again at the next boot if refused

    # ---- dispatch ----------------------------------------------------------------------------------
    def handle_packet(self, data: bytes) -> None:
        """A packet from the bus (main thread). Decoding, the replay guard and the quarantine are
        in memory; PING and STATUS are answered here, everything else runs on the command thread
        (or here, when no command thread runs: in-process tests and fuzzers)."""
        try:
            header, message = decode_packet(data)
        except WireError as err:
            self._reject(m.Rejected.from_error(err), err.code)
            return
        if not message.is_command():
            # the bus's own messages (warnings, power state, telemetry the cadence reads); any
            # other telemetry type sent to the payload is ignored
            bus_handler = self.handlers.get(message.TYPE)
            if bus_handler is None:
                return
            if isinstance(message, m.PowerStateChange):
                # its verdict counts abnormal exits: a durable write, the command thread's to do
                self._later(lambda: bus_handler(header, message))
            else:
                bus_handler(header, message)  # warnings and telemetry change memory only
            return
        request = header.request
        at_once = message.TYPE in ANSWERED_AT_ONCE
        if not self._replay_checked(request, record=at_once):
            return
        item = command_item(message)
        if self.health.is_quarantined(item):
            self._reject(
                m.Rejected.about(
                    request,
                    code=ResponseCode.QUARANTINED,
                    task_id=getattr(message, "task_id", None),
                    reason=clip_reason(f"{item} is quarantined after repeated abnormal exits"),
                ),
                ResponseCode.QUARANTINED,
            )
            return
        if at_once:
            self._dispatch(request, message, item)
        else:
            self._later(lambda: self._dispatch_in_turn(request, message, item))

    def _dispatch_in_turn(self, request: RequestRef, message: m.Message, item: str) -> None:
        """On the command thread: the number recorded now, right before its command runs."""
        if self._replay_checked(request, record=True):
            self._dispatch(request, message, item)

    def _replay_checked(self, request: RequestRef, record: bool) -> bool:
        """The replay guard: False (and a rejection) for a number already accepted. A command run
        on the command thread is *recorded* there, just before it runs, and only checked as it
        arrives: the guard on disk must never hold the number of a command whose effect is not
        on disk yet, or a cut in between would make its redelivery look like a replay and lose
        it."""
        try:
            with self.state.lock:
                if record:
                    self.state.guard.accept(request.apid, request.source_id, request.seq)
                    self.state.dirty = True
                else:
                    self.state.guard.check(request.apid, request.source_id, request.seq)
        except ReplayError as err:
            what = "replayed" if err.code == ResponseCode.REPLAYED_SEQUENCE else "far-ahead"
            self.event(EventId.REPLAY_DETECTED, f"{what} {MessageType(request.message_type).name} seq {request.seq}")
            self._reject(m.Rejected.from_error(err, request), err.code)
            return False
        return True

    def _later(self, job) -> None:
        """Run `job` on the command thread, in order (inline when there is none)."""
        if self._command_thread is None:
            job()
        else:
            self.jobs.put(job)

    def _dispatch(self, request: RequestRef, message: m.Message, item: str) -> None:
        """One telecommand to its handler; whatever it raises becomes a REJECTED with a code."""
        task_id = getattr(message, "task_id", None)
        handler = self.handlers.get(message.TYPE)
        try:
            refusal = self._storage_refusal(message)
            if refusal is not None:
                raise refusal
            with self.health.handling(item, self._slot()):
                if handler is None:
                    raise WireError(ResponseCode.UNKNOWN_COMMAND, f"no handler for {message.TYPE.name}")
                handler(request, message)
        except WireError as err:
            self._reject(m.Rejected.from_error(err, request, task_id), err.code)
        except OSError as exc:
            # The disk refused (full, read-only, I/O error): the environment's doing, reported
            # through the storage state and never counted against the command.
            code = ResponseCode.INTERNAL_ERROR
            if self._storage_failed(exc, f"{message.TYPE.name} handler"):
                code = STORAGE_CODES.get(self.storage.state, ResponseCode.STORAGE_FULL)
            self._reject(
                m.Rejected.about(
                    request, code=code, reason=clip_reason(f"{type(exc).__name__}: {exc}"), task_id=task_id
                ),
                code,
            )
        except Exception as exc:  # noqa: BLE001 - a handler defect rejects this command, nothing more
            self._fault(EventId.COMMAND_FAULT, f"{message.TYPE.name} handler failed", exc, item)
            self._reject(
                m.Rejected.about(
                    request,
                    code=ResponseCode.HANDLER_FAULT,
                    task_id=task_id,
                    reason=clip_reason(f"{type(exc).__name__}: {exc}"),
                ),
                ResponseCode.HANDLER_FAULT,
            )

    def _accept(self, request: RequestRef, **fields) -> None:
        """The command is valid: count it and acknowledge it. A command that changes state has
        its replay guard and counters saved first (on the command thread); a query's are saved
        with the next write. If the disk refuses that save, the command's own effect is already
        durable and every handler is idempotent for a repeated number, so it is still
        acknowledged, and the state stays dirty until the disk takes it."""
        with self.state.lock:
            self.state.counters.command_count += 1
            self.state.dirty = True
        if request.message_type not in QUERIES:
            try:
                self.state.save()
            except OSError as exc:
                if not self._storage_failed(exc, "saving the replay guard"):
                    raise
        self.send(m.Accepted.about(request, **fields))

    def _reject(self, report: m.Rejected, code: ResponseCode) -> None:
        """A rejection changes nothing to protect: its counter is saved with the next write.
        RESULT_NOT_READY to a DOWNLINK_RESULT is the answer "not yet" to a valid query about a
        task that has not finished (a ground waiting for a result asks it), not a fault: it is
        neither counted in ERROR_COUNT nor logged as a rejection (docs/wire-protocol.md)."""
        if report.not_yet:
            self.log.info("result_not_ready", reason=report.reason)
            self.send(report)
            return
        with self.state.lock:
            self.state.counters.error_count += 1
            self.state.dirty = True
        self.log.warning("command_rejected", code=ResponseCode(code).name, reason=report.reason)
        self.send(report)

    # ---- the command thread --------------------------------------------------------------------------
    def _command_loop(self) -> None:
        """Runs the handlers that write and every write the main thread must not wait on, in
        order, then its own housekeeping every TICK_S. A disk that stalls stalls this thread
        only."""
        next_tick = 0.0
        next_count = 0.0
        while not self.stop.is_set():
            try:
                job = self.jobs.get(timeout=TICK_S)
            except queue.Empty:
                job = None
            if job is not None:
                try:
                    job()
                except Exception as exc:  # noqa: BLE001 - the thread itself never ends on a fault
                    self._fault(EventId.MAIN_LOOP_FAULT, "command thread", exc)
                if not self.jobs.empty():
                    continue  # commands first; the housekeeping below once they are done
            now = time.monotonic()
            if now < next_tick:
                continue
            next_tick = now + TICK_S
            try:
                self._tick(now >= next_count)
            except Exception as exc:  # noqa: BLE001
                self._fault(EventId.MAIN_LOOP_FAULT, "command thread housekeeping", exc)
            if now >= next_count:
                next_count = now + CHECKPOINT_COUNT_EVERY_S

    def _tick(self, count_checkpoints: bool) -> None:
        self.health.expire()
        self.health.flush()
        if self._deferred_reports and not self.health.suspects:
            deferred, self._deferred_reports = self._deferred_reports, set()
            for task_id in sorted(deferred):
                self.send_final_report(self.queue.get(task_id))
        self.storage.check()
        if self.storage.allows_writes():
            try:
                if self.state.dirty:
                    self.state.save()
                if self.tm_counter.wants_reserve():
                    self.tm_counter.reserve([Apid.PAYLOAD])
            except OSError as exc:
                if not self._storage_failed(exc, "saving the payload's state"):
                    raise
        if count_checkpoints:
            self._checkpoint_bytes_seen = self._checkpoint_bytes()

    # ---- worker ----------------------------------------------------------------------------------------
    def _task_dir(self, task_id: str) -> str:
        return os.path.join(self.data_dir, "tasks", task_id)

    def _next_runnable(self):
        if not self.storage.allows_writes():
            return None  # a task's start and end are writes: none starts until the disk takes them
        if self.health.dirty:
            return None  # a count not yet on disk must be before anything that could kill again
        pending = self.queue.pending()
        if any(self.health.held(task_item(t.task_id)) for t in pending):
            return None  # until the bus says how the last boot ended (at most health.VERDICT_WAIT_S)
        for task in pending:
            if self.health.is_quarantined(task_item(task.task_id)):
                continue
            if all(self.images.is_verified(name) for name in task.images):
                return task
        return None

    def _load_engine(self):
        """The model, loaded once. Every boot-time fault of the engine counts against `engine:load`
        like any item: the imports of torch and the loader run inside its handling, so a boot that
        dies there (the OOM killer during `import torch`) is counted by the next one, and a load
        that raises is a fault (an event each time, retried); at EXIT_BOUND it is quarantined and
        the payload answers commands without running tasks. A model directory that is missing or
        unreadable is the environment's doing, not the engine's: it is reported (BOOT_FAULT, once
        per problem), never counted, and looked for again every MODEL_RECHECK_S."""
        model_problem: str | None = None
        while not self.stop.is_set():
            if self.health.is_quarantined(ENGINE_ITEM):
                self.stop.wait(ENGINE_RETRY_S)  # safe mode: commands only, until the ground releases it
                continue
            if self.health.held(ENGINE_ITEM):
                # The last boot ended loading the engine: wait for the bus's word on how it ended
                # (at most health.VERDICT_WAIT_S) before trying again, or a load that kills would
                # kill this boot too before it is counted.
                self.stop.wait(0.05)
                continue
            problem = self._model_problem()
            if problem is not None:
                if problem != model_problem:
                    self.event(
                        EventId.BOOT_FAULT,
                        f"{problem}; the payload answers commands and runs no task until it is there "
                        f"(looked for every {MODEL_RECHECK_S:g} s)",
                    )
                model_problem = problem
                self.stop.wait(MODEL_RECHECK_S)
                continue
            if model_problem is not None:
                self.log.info("model_found", model=self.model_dir, was=model_problem)
                self.images.limits = ProcessorLimits.of_model_dir(self.model_dir)  # read at boot without it
                model_problem = None
            try:
                with self.health.handling(ENGINE_ITEM, WORKER):
                    # lazy: torch/transformers (seconds), behind a link that is already up (run())
                    import torch

                    if getattr(self.options, "threads", None):
                        torch.set_num_threads(self.options.threads)  # before any tensor op: pinned per request
                    import flight.engine  # noqa: F401  (what _run_task imports: its cost is the load's)
                    from flight.model.loader import load_model

                    model = load_model(
                        self.model_dir,
                        device=self.device,
                        dtype=self.dtype,
                        read_hook=self.weight_read_hook,
                        lazy_processors=True,
                    )
                # Loaded: whatever killed a load before is behind it, as a unit of work is for a
                # task (else OOM kills during loads months apart would add up to a quarantine).
                self.health.progress(ENGINE_ITEM)
                return model
            except Exception as exc:  # noqa: BLE001 - MemoryError and ImportError included
                self._fault(EventId.WORKER_FAULT, "engine load failed", exc, ENGINE_ITEM)
                self.stop.wait(ENGINE_RETRY_S)
        return None

    def _model_problem(self) -> str | None:
        """What keeps the model directory from being loaded, in words, or None. Plain file checks
        (no torch): config.json names a supported architecture and weight files are there."""
        from flight.model.config import ModelError, read_model_type, weight_files

        try:
            read_model_type(self.model_dir)
            if not weight_files(self.model_dir):
                return f"no weight files (*.safetensors) in model directory {self.model_dir}"
        except ModelError as exc:
            return f"model unavailable: {exc}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"model directory {self.model_dir} unreadable: {type(exc).__name__}: {exc}"
        return None

    def worker(self) -> None:
        model = self._load_engine()
        while model is not None and not self.stop.is_set():
            task = None
            try:
                task = self._next_runnable()
                if task is None:
                    self.current.idle()
                    self.work_available.wait(0.5)
                    self.work_available.clear()
                    continue
                self._run_task(model, task)
            except Exception as exc:  # noqa: BLE001 - a fault around one task stops that task, not the payload
                self.engine = None
                if self._storage_failed(exc, f"task {task.task_id}" if task else "worker"):
                    # The disk, not the task: nothing counted, the task stays queued and runs
                    # again once the storage state allows (work_available is set then).
                    self.stop.wait(FAULT_BACKOFF_S)
                    continue
                self._fault(
                    EventId.WORKER_FAULT,
                    f"worker failed{f' on task {task.task_id}' if task else ''}",
                    exc,
                    task_item(task.task_id) if task else None,
                )
                self.engine = None
                self.stop.wait(FAULT_BACKOFF_S)

    def _task_images(self, task) -> list[bytes] | None:
        """The task's images, each checked against its SHA-256; None (the task waits for the
        ground to send a damaged one again) if one no longer matches."""
        contents = []
        for name in task.images:
            try:
                contents.append(self.images.read_verified(name))
            except ImageCorrupt as exc:
                self.awaited_images.note(task.task_id, name)
                self.event(
                    EventId.IMAGE_CORRUPT,
                    f"task {task.task_id} waits: image {name} {exc.reason}; removed, "
                    f"the ground must send it again ({ResponseCode.IMAGE_CORRUPT.name})",
                    task.task_id,
                )
                return None
        self.awaited_images.clear(task.task_id)
        return contents

    def _run_task(self, model, task) -> None:
        # lazy: torch/transformers (seconds): the payload answers the bus first (0.5 s budget)
        from flight.engine import Engine
        from flight.model.inputs import InputError

        item = task_item(task.task_id)
        with self.health.handling(item, WORKER):
            inputs = self._stored_inputs(task, model)
            # Images are read (and re-verified) only when the inputs must be built from them.
            contents = self._task_images(task) if inputs is None else None
            if inputs is None and contents is None:
                return
            resumed = task.state == RUNNING
            self.queue.start(task.task_id)
            request = task.request
            # Ends the run at a unit boundary: a CANCEL_TASK (through `current`), or the process's
            # stop (SIGTERM, SIGINT: `self.stop` pauses it). The task then stays RUNNING on disk and
            # the next boot resumes it as after a cut; the worker is out of torch before the
            # interpreter exits (exiting with a thread inside torch aborts the process, SIGABRT,
            # which its crash record would count against the task as an abnormal exit).
            stop = StopToken(paused_by=self.stop)
            self.current.start(task.task_id, TaskPhase.RECOVERING if resumed else TaskPhase.VISION, stop)
            self.send(m.Started.about(request, task_id=task.task_id))
            self.profile.task_started(time.monotonic())
            self.event(
                EventId.TASK_RESUMED if resumed else EventId.TASK_STARTED,
                f"task {task.task_id} "
                f"{'resumed after ' + str(task.interruptions) + ' cut(s)' if resumed else 'started'}",
                task.task_id,
            )
            try:
                if inputs is None:
                    assert contents is not None  # read above whenever there are no stored inputs
                    inputs = self._build_inputs(task, model, contents)
                    del contents
                engine = Engine(
                    model,
                    self.options,
                    fs=self.checkpoint_fs,
                    events=self._engine_events(task, request, stop),
                    cadence=self.cadence,
                )
                self.engine = engine
                t0 = time.monotonic()
                run = engine.run_or_stop(
                    inputs, os.path.join(self._task_dir(task.task_id), "ckpt"), task.max_new_tokens, stop
                )
            except ImagesAwaited:
                return  # an image was found damaged and removed: the task runs again once it is resent
            except InputError as exc:
                self._fail(task, request, exc.code, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a failed task must not stop the payload
                if storage_condition(exc) is not None:
                    raise  # the disk, not the task: the worker waits it out (never a failure)
                self.log.exception("task_failed", task_id=task.task_id)
                self._fail(task, request, ResponseCode.INFERENCE_ERROR, f"{type(exc).__name__}: {exc}")
                return
            finally:
                self.engine = None
            if run.status == RunStatus.CANCELLED:
                self.current.cancel_done(task.task_id)
                self._until_stored(lambda: self.commands.finish_cancel(task), f"cancelling task {task.task_id}")
                return
            if run.status == RunStatus.PAUSED:
                self.log.info("task_paused_for_stop", task_id=task.task_id)
                return
            result = run.result
            assert result is not None  # FINISHED
            timings = dict(result.phase_seconds)
            timings["total_this_boot"] = time.monotonic() - t0
            self.profile.task_ended(task.max_new_tokens)
            self.jobs.put(self._send_profile)
            outcome = {
                "token_ids": result.token_ids,
                "text": result.text,
                "logits_sha256": result.logits_sha256(),
                "timings": timings,
                "bytes_written": result.bytes_written,
            }
            # The answer exists only in memory until this write: held there, not recomputed,
            # while the disk refuses it (a cut meanwhile resumes from the checkpoints).
            if not self._until_stored(lambda: self.queue.complete(task.task_id, outcome), f"task {task.task_id}"):
                return
        shutil.rmtree(
            self._task_dir(task.task_id), ignore_errors=True
        )  # finished and durable: checkpoints and inputs go
        self.current.set_phase(TaskPhase.COMPLETED)
        self.event(
            EventId.TASK_COMPLETED,
            f"task {task.task_id} completed: {len(result.token_ids)} tokens, {task.interruptions} cut(s) survived",
            task.task_id,
        )
        self.send_final_report(self.queue.get(task.task_id))
        self.send(self.housekeeping())  # the queue changed: say so at once

    def _inputs_path(self, task_id: str) -> str:
        return os.path.join(self._task_dir(task_id), "inputs.rec")

    def _inputs_key(self, task, model) -> dict:
        return {"task": task.content_hash, "model": model.content_hash, "processors": processors_hash(model.model_dir)}

    def _stored_inputs(self, task, model):
        """The task's preprocessed inputs as stored at its first start (TASK_INPUTS,
        docs/record-format.md), or None -- a resumed task needs no tokenizer, image processor or
        PIL before its last step."""
        # lazy: torch/transformers (seconds): the payload answers the bus first (0.5 s budget)
        from flight.model.inputs import load_inputs

        inputs, why = load_inputs(
            self.fs,
            self._inputs_path(task.task_id),
            self._inputs_key(task, model),
            rebuild_pixels=lambda reason: self._rebuilt_pixels(task, model, reason),
        )
        if why is not None:
            self.log.warning("task_inputs_rebuilt", task_id=task.task_id, reason=why)
        return inputs

    def _rebuilt_pixels(self, task, model, reason: str):
        """The pixel patches of a task whose stored ones cannot be used (asked for only when its
        vision phase runs from them), built again from its verified images and stored again; the
        task waits for the ground (ImagesAwaited) if an image no longer matches."""
        self.log.warning("task_pixels_rebuilt", task_id=task.task_id, reason=reason)
        contents = self._task_images(task)
        if contents is None:
            raise ImagesAwaited(task.task_id)
        return self._build_inputs(task, model, contents).pixel_values

    def _build_inputs(self, task, model, contents: list[bytes]):
        """Tokenize and process the task's verified images once, and store the result."""
        # lazy: torch/transformers (seconds): the payload answers the bus first (0.5 s budget)
        from flight.model.inputs import build_inputs, decode_image, save_inputs

        images = [
            decode_image(content, name, model.image_processor)
            for name, content in zip(task.images, contents, strict=True)
        ]
        inputs = build_inputs(model.tokenizer, model.image_processor, images, task.prompt, model.adapter.image_token_id)
        del images
        try:
            self.fs.makedirs(self._task_dir(task.task_id))
            # A cut during an earlier try at this write left its temporary: without this, each
            # cut before the inputs are durable would leave one more on the disk.
            self.fs.remove_stale_temps(self._task_dir(task.task_id))
            # Growth, like a checkpoint: through the gate that keeps it out of a degraded disk.
            save_inputs(self.growth_fs, self._inputs_path(task.task_id), inputs, self._inputs_key(task, model))
        except OSError as exc:  # a full or read-only disk costs the shortcut, not the task
            if not self._storage_failed(exc, f"storing the inputs of task {task.task_id}"):
                raise
            self.log.warning("task_inputs_not_stored", task_id=task.task_id, reason=str(exc.strerror))
        return inputs

    def _until_stored(self, store, what: str) -> bool:
        """Run `store` (a durable write of the worker's) until the disk takes it: a storage
        condition is reported and waited out, never charged to the task. False if the payload
        stops first (the task then stays as it is on disk, and the next boot takes it up)."""
        while True:
            try:
                store()
                return True
            except OSError as exc:
                if not self._storage_failed(exc, what):
                    raise
            if self.stop.wait(1.0):
                return False

    def _fail(self, task, request, code: ResponseCode, reason: str) -> None:
        if not self._until_stored(lambda: self.queue.fail(task.task_id, code, reason), f"task {task.task_id}"):
            return
        self.send_final_report(self.queue.get(task.task_id))
        self.event(EventId.TASK_FAILED, f"task {task.task_id} failed: {ResponseCode(code).name}", task.task_id)

    def _engine_events(self, task, request, stop: StopToken):
        last_sent = {"t": 0.0}
        item = task_item(task.task_id)

        def on_event(event: EngineEvent, **fields: Any) -> None:
            name = event
            if name == EngineEvent.REQUEST_OPENED:
                phase = fields.get("phase")
                if phase not in (None, "start"):
                    self.event(
                        EventId.RECOVERY_PLANNED,
                        f"task {task.task_id} resumes in {phase} at {fields.get('position')}",
                        task.task_id,
                    )
            elif name == EngineEvent.MANIFEST_MISMATCH:
                self.event(
                    EventId.CHECKPOINT_MANIFEST_MISMATCH,
                    f"task {task.task_id}: checkpoints from another configuration, restarting",
                    task.task_id,
                )
            elif name == EngineEvent.RECORD_REJECTED:
                self.event(
                    EventId.CHECKPOINT_CORRUPT,
                    f"task {task.task_id}: rejected {fields.get('file')} ({fields.get('reason')})",
                    task.task_id,
                )
            elif name == EngineEvent.EARLY_RECORD:  # in the payload's log: the simulator's count is checked against it
                self.log.info(EngineEvent.EARLY_RECORD, task_id=task.task_id, phase=fields.get("phase"))
            elif name == EngineEvent.VISION_STATE_SKIPPED:  # the adaptive cadence's skip rule, in the payload's log
                self.log.info(name, task_id=task.task_id, **fields)
            elif name in (EngineEvent.RECOVERY_PLAN, EngineEvent.PREFILL_RESTORED):  # a restart's plan and its cost
                self.log.info(name, task_id=task.task_id, **fields)
            elif name == EngineEvent.CHECKPOINT_WRITE_FAILED:
                # The disk refused a checkpoint (the engine goes on without it). The storage state
                # says so once (STORAGE_FULL, ...); the record skipped is an event at most every
                # FAULT_EVENT_EVERY_S, not one per record while the disk stays full.
                was_ok = self.storage.allows_growth()
                self.storage.failed_errno(fields.get("errno"), f"checkpoint {fields.get('record')}")
                now = time.monotonic()
                if was_ok and now - self._disk_full_reported_at >= FAULT_EVENT_EVERY_S:
                    self._disk_full_reported_at = now
                    self.event(
                        EventId.DISK_FULL,
                        f"task {task.task_id}: checkpoint {fields.get('record')} skipped ({fields.get('reason')})",
                        task.task_id,
                    )
            phase = UNIT_EVENTS.get(name)
            if phase is None:
                return
            self.health.progress(item)  # a unit done: whatever killed this task before is behind it
            if stop.requested() is not None:
                return  # the engine ends the task at this boundary: its record is not kept, nor reported
            if phase == TaskPhase.VISION:
                done, total = fields["block"], fields["of"]
            elif phase == TaskPhase.PREFILL:
                done, total = fields["done"], fields["of"]
            else:
                done, total = fields["step"], fields["of"]
            changed = phase != self.current.advance(phase, done, total).phase
            now = time.monotonic()
            self.profile.unit(str(phase), done, total, now, now - self.started)
            if changed:  # kept at each phase change: a cut must not take a window's measurements with it
                self.jobs.put(self._save_profile)
            if changed or done == total or now - last_sent["t"] > 0.1:
                last_sent["t"] = now
                self.send(m.Progress.about(request, task_id=task.task_id, phase=phase, done=done, total=total))

        return on_event

    # ---- main loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        self.health.arm_crash_record()
        with self.state.lock:
            self.state.counters.boot_count += 1
            self.state.dirty = True
        # Nothing on this thread waits on the disk from here on (docs/flight.md "Threads"): the
        # boot's own writes -- its count, the telemetry reservation, the window log -- are the
        # command thread's first jobs, so a full, read-only or stalled disk delays none of the
        # first heartbeat, the BOOT event or a PING's answer.
        self.health.defer_saves = True
        self.jobs.put(self._boot_writes)
        commands = self._command_thread = threading.Thread(
            target=self._command_loop, name="command-handler", daemon=True
        )
        commands.start()
        ctx: zmq.Context = zmq.Context.instance()
        sock = client_socket(ctx, zmq.DEALER, self.layout, "payload", self.endpoint)
        self.log.info(
            "flight_booted",
            boot=self.state.counters.boot_count,
            endpoint=self.endpoint,
            cadence=self.cadence.mode,  # this payload logs each early record (early_record)
            pending=[t.task_id for t in self.queue.pending()],
            storage=self.storage.state.value,
        )
        self.send(
            m.Heartbeat(boot_count=self.state.counters.boot_count, uptime_s=0.0)
        )  # first: the bus learns the boot
        self._heartbeat_queued.set()
        self.event(EventId.BOOT, f"payload boot {self.state.counters.boot_count}; {self.queue.depth()} task(s) pending")
        self._boot_events()
        for task in self.queue.unreported():
            self.send_final_report(task)  # ended before the last cut, but its report never left
        worker = self._worker_thread = threading.Thread(
            target=self._worker_guarded, name="inference-worker", daemon=True
        )
        worker.start()
        timers = {"heartbeat": 0.0, "housekeeping": 0.0}
        unsent: list[tuple[bytes, object]] = []
        try:
            while not self.stop.is_set():
                try:
                    self._loop_once(sock, timers, unsent)
                except Exception as exc:  # noqa: BLE001 - the loop itself never ends on a fault
                    self._fault(EventId.MAIN_LOOP_FAULT, "main loop", exc)
                    self.stop.wait(FAULT_BACKOFF_S)
        finally:
            self.stop.set()
            sock.close(linger=200)
            worker.join(STOP_WAIT_S)  # to the end of its unit of work (the task's StopToken, paused by self.stop)
            if worker.is_alive():
                self.log.warning("worker_busy_at_stop", waited_s=STOP_WAIT_S, task=self.current.snapshot().task)
            commands.join(STOP_WAIT_S)  # a write in progress ends (or the disk is stalled)
            self._final_writes()
        return 0

    def _boot_writes(self) -> None:
        """The boot's own writes, first on the command thread: the boot count (and the replay
        guard with it), the telemetry numbers reserved ahead, the window log."""
        if self.storage.allows_writes():
            try:
                self.state.save()
                self.tm_counter.reserve([Apid.PAYLOAD])
            except OSError as exc:
                if not self._storage_failed(exc, "saving the boot count"):
                    raise
        self._start_window_log()

    def _final_writes(self) -> None:
        """At a stop (not a cut): what is still only in memory, if the disk takes it at once."""
        if self._command_thread is not None and self._command_thread.is_alive():
            return  # stuck on the disk: the process leaves without waiting for it
        try:
            self.health.flush()
            if self.state.dirty and self.storage.allows_writes():
                self.state.save()
        except OSError as exc:
            self.log.warning("final_writes_failed", error=str(exc))

    def worker_busy(self) -> bool:
        """Whether the worker thread is still running after run() returned (e.g. inside a weight
        load at the stop): then the caller must leave with os._exit, not through the interpreter's
        shutdown, which aborts with a thread inside torch."""
        return self._worker_thread is not None and self._worker_thread.is_alive()

    def _boot_events(self) -> None:
        if self.state.corrupt:
            self.event(EventId.STATE_CORRUPT, "replay-guard/counter state unreadable; started afresh")
        if self.health.corrupt:
            self.event(EventId.STATE_CORRUPT, "health and safety state unreadable; abnormal-exit counts started afresh")
        damage = self.queue.damage
        if damage.tail_bytes:
            self.event(
                EventId.UNCLEAN_SHUTDOWN_DETECTED, f"queue journal: dropped a torn tail of {damage.tail_bytes} bytes"
            )
        if damage.records_dropped:
            self.event(
                EventId.JOURNAL_CORRUPT,
                f"queue journal: skipped {damage.bytes_dropped} damaged bytes in "
                f"{damage.records_dropped} region(s), kept every valid record after them",
            )
        if damage.named or damage.unnamed:
            names = ", ".join(damage.named[:20]) + (" ..." if len(damage.named) > 20 else "")
            unnamed = f"; {damage.unnamed} more could not be named" if damage.unnamed else ""
            self.event(
                EventId.TASKS_LOST,
                f"{len(damage.named)} task(s) lost to storage damage: {names or '-'}{unnamed}; "
                "LIST_LOST_TASKS lists them, a re-sent one is recognised",
            )

    def _loop_once(self, sock, timers: dict, unsent: list) -> None:
        """One turn of the main thread: heartbeat and housekeeping from memory, packets out and
        in. Nothing here waits on the disk (a report's bookkeeping once it has left is a job for
        the command thread)."""
        now = time.monotonic()
        if now >= timers["heartbeat"]:
            timers["heartbeat"] = now + HEARTBEAT_S
            work = self.current.snapshot()
            self.send(
                m.Heartbeat(
                    boot_count=self.state.counters.boot_count,
                    uptime_s=now - self.started,
                    current_task=work.task,
                    phase=work.phase,
                )
            )
        if now >= timers["housekeeping"]:
            timers["housekeeping"] = now + HOUSEKEEPING_S
            self.send(self.housekeeping())
        self._watch_stall(now)
        while unsent or not self.outbox.empty():
            if not unsent:
                unsent.append(self.outbox.get_nowait())
            packet, on_sent = unsent[0]
            try:
                send_packet(sock, packet, timeout_s=0.2)
            except LinkError as exc:  # the bus is away: keep the packet, try again later
                self.log.warning("send_failed", error=str(exc))
                break
            unsent.pop(0)
            if on_sent is not None:
                self._later(lambda on_sent=on_sent: self._after_sent(on_sent))
        received = recv_packet(sock, timeout_s=0.05)
        if received is not None:
            self.handle_packet(received.packet)

    def _after_sent(self, on_sent) -> None:
        try:
            on_sent()
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the report goes again next boot
            if not self._storage_failed(exc, "recording a sent report"):
                self._fault(EventId.MAIN_LOOP_FAULT, "recording a sent report", exc)

    def _start_window_log(self) -> None:
        """Log the window the last boot lived through and keep this one's length on disk."""
        if self.windows is None:
            return
        windows = self.windows
        try:
            lengths = windows.open(self.state.counters.boot_count)
            self.cadence.set_windows(lengths)
        except OSError as exc:  # the history is advice: without it the cadence is the fixed one
            self.log.warning("window_log_unavailable", error=str(exc))
            return
        self._send_window_history(lengths)
        costs = WriteCosts(windows.dir)
        try:
            learned = costs.load()
            self.cadence.learn_writes(learned)
            if learned:
                self.log.info("write_costs_loaded", **{f"{phase}_s": round(s, 6) for phase, s in learned.items()})
        except OSError as exc:  # advice too: the cadence measures its writes again
            self.log.warning("write_costs_unavailable", error=str(exc))
        if costs.damaged:
            self.log.warning("write_costs_ignored", path=costs.path, reason="not a valid entry")

        def keep_costs() -> None:
            costs.save(self.cadence.learned_writes())

        threading.Thread(
            target=windows.keep_marking, args=(self.stop, keep_costs), name="window-log", daemon=True
        ).start()

    def _send_window_history(self, lengths: list[float]) -> None:
        """WINDOW_HISTORY and PAYLOAD_PROFILE, at power-on (command thread, before any STATUS is
        answered): the windows lived through, each with its start on this payload's clock."""
        path = os.path.join(self.data_dir, "state", "window-starts.log")
        try:
            starts = append_start(self.fs, path, time.time() - (time.monotonic() - self.started))
        except OSError as exc:  # advice only: the ground says it cannot forecast
            self.log.warning("window_starts_unavailable", error=str(exc))
            return
        # lengths are of the ended windows, oldest first; the newest start is this window's
        paired = min(len(lengths), len(starts) - 1)
        self._heartbeat_queued.wait(HEARTBEAT_FIRST_WAIT_S)
        self._window_history = m.WindowHistory(
            boot_count=self.state.counters.boot_count,
            starts=starts[len(starts) - 1 - paired :],
            lengths=lengths[len(lengths) - paired :] if paired else [],
        )
        self.send(self._window_history)
        self._send_profile(save=False)

    def forecast_messages(self) -> list[m.Message]:
        """WINDOW_HISTORY (once this boot has logged its window) and PAYLOAD_PROFILE, from memory:
        sent before the HOUSEKEEPING that answers STATUS, so that a ground that was not listening
        at power-on still gets the forecast's inputs (main thread: no disk)."""
        return ([self._window_history] if self._window_history is not None else []) + [self._profile_message()]

    def _save_profile(self) -> None:
        """Keep what was measured (command thread)."""
        try:
            self.profile.save(self.fs)
        except OSError as exc:  # advice only: measured again
            self.log.warning("profile_unsaved", error=str(exc))

    def _send_profile(self, save: bool = True) -> None:
        """PAYLOAD_PROFILE (at power-on and after each task; command thread: it saves first)."""
        if save:
            self._save_profile()
        self.send(self._profile_message())

    def _profile_message(self) -> m.PayloadProfile:
        options = self.options if self.options is not None else EngineOptions()
        geometry = options.geometry
        return m.PayloadProfile(
            model=clip_utf8(os.path.basename(os.path.normpath(self.model_dir)) if self.model_dir else "", 128),
            policy=options.policy,
            cadence=self.cadence.mode,
            durable_every={"vision": geometry.vision_every, "prefill": 1, "decode": geometry.decode_every},
            **self.profile.fields(),
        )

    def _worker_guarded(self) -> None:
        """The worker catches everything itself; this is the last line, which keeps the process
        (and its command handling) alive if something escapes anyway."""
        while not self.stop.is_set():
            try:
                self.worker()
                return
            except BaseException as exc:  # noqa: BLE001
                self._fault(EventId.FATAL_ERROR, "inference worker", exc)
                self.stop.wait(ENGINE_RETRY_S)
