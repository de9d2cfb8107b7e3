"""The onboard process: command dispatch, the inference worker, telemetry.

    main thread     the payload link (ZeroMQ DEALER to the bus): receive telecommands, decode,
                    replay-check, dispatch (dispatch.py) -- PING and STATUS answered at once --,
                    send what the outbox holds (outbox.py), heartbeat and housekeeping
                    (housekeeping.py)
    command thread  every handler that writes (handlers.py) and every write the main thread must
                    not wait on, in order, and its own upkeep between them (jobs.py)
    worker thread   takes the next task from the persistent queue and runs the resumable engine
                    (worker.py); its progress becomes PUS-1 PROGRESS reports

`FlightApp` owns what the threads share -- the stop, the worker's wake-up, the persistent
state and counters (state.py), what the worker is on and the engine at work (current.py), the
queue, the images, health and safety, the storage state -- and builds the parts, each handed
what it uses. What crosses threads is behind a lock or passed as a message (a job, a packet).

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

import functools
import shutil
import threading
import time
from pathlib import Path

import zmq

from common import log as owlog
from common.durable import DurableFS, best_effort
from common.imagecheck import ProcessorLimits
from common.wire import Apid, EventId
from common.wire import messages as m
from common.wire.link import KeyLayout, LinkError, client_socket, recv_packet, send_packet
from flight.checkpoint.cadence import Cadence
from flight.options import resolve_cadence

from .config import DataPaths, FlightConfig
from .current import CurrentWork
from .dispatch import Dispatcher, Verdicts
from .forecast import Forecast
from .handlers import MAX_QUEUED, CommandHandlers, PayloadServices  # noqa: F401  (MAX_QUEUED: re-exported)
from .health import Health
from .housekeeping import Housekeeping
from .images import AwaitedImages, ImageStore
from .inputs import TaskInputs
from .jobs import CommandJobs
from .outbox import Outbox, Outgoing, telemetry_counter
from .queue import TaskQueue
from .reports import WORKER_THREAD, Faults, FinalReports, Notices, QuarantineNotice, task_result
from .state import PersistentState
from .storage import GatedFS, Storage
from .worker import FAULT_BACKOFF_S, Worker

HEARTBEAT_S = 1.0
HOUSEKEEPING_S = 5.0
#: On a stop (SIGTERM, SIGINT), how long the process waits for the worker to reach the end of its
#: unit of work (where the engine looks at the task's StopToken, which `self.stop` pauses). A unit
#: takes well under this on the target; a weight load may not (then see `worker_busy`).
STOP_WAIT_S = 30.0


class FlightApp:
    """The payload process: its shared state, its parts, and the main thread's loop (`run`)."""

    def __init__(self, config: FlightConfig, cadence: Cadence | None = None):
        self.config = config
        self.paths = DataPaths.under(config.data_dir)
        self.fs = config.fs or DurableFS()
        self.layout = KeyLayout(Path(config.keys_dir))
        self.log = owlog.get(component="flight")
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.work_available = threading.Event()
        self.current = CurrentWork()  # the worker writes it; the main and command threads read it
        self.awaited_images = AwaitedImages()  # task id -> image found damaged, waiting to be sent again
        self._worker_thread: threading.Thread | None = None
        # The replay guard and counters first: their directory is the one the telemetry
        # counter and the window log keep their files in.
        self.state = PersistentState(self.paths.state, self.fs)
        self.outbox = Outbox(telemetry_counter(self.paths.state, self.fs, self.log), self.log)
        self.notices = Notices(self.outbox, self.paths, self.work_available)
        # The data disk as an environment condition (storage.py): its state decides what is
        # refused; a write failing with ENOSPC, EROFS or EIO moves it, and is never a task's fault.
        self.storage = Storage(
            self.paths.root,
            self.fs,
            config.storage_reserve_bytes,
            on_change=self.notices.storage_changed,
            log=self.log,
        )
        # The engine's checkpoint records: the same disk, but a target-emulating testbench
        # charges them apart from the process's own data (flight/cli_options.data_storage_for),
        # and while the disk is degraded they are refused before they reach it.
        self.checkpoint_fs = GatedFS(config.checkpoint_fs or self.fs, self.storage)
        queue_options = {} if config.compact_after is None else {"compact_after": config.compact_after}
        self.queue = TaskQueue(
            self.paths.join("queue"),
            self.fs,
            results_dir=self.paths.join("results"),
            results_budget_bytes=config.results_budget_bytes,
            on_evict=self.notices.result_evicted,
            **queue_options,
        )
        self.images = ImageStore(self.paths.join("images"), self.fs, ProcessorLimits.of_model_dir(config.model_dir))
        self.health = Health(
            self.paths.join("health"),
            self.fs,
            boot=self.state.counters_now().boot_count + 1,
            on_event=QuarantineNotice(self.outbox, self.queue),
            log=self.log,
        )
        self._name_orphaned_tasks()
        self.storage.open()
        self.faults = Faults(self.outbox, self.health, self.log)
        self.final_reports = FinalReports(self.outbox, self.queue, self.health, self.faults)
        self.jobs = CommandJobs(self.stop, self.faults)
        # Checkpoint cadence: fed with warnings, bus telemetry and the windows lived through
        # (flight/checkpoint/cadence.py); shared by every task of this boot. Options that name no
        # cadence get their policy's default (flight/options.py), as the engine's own would.
        options = config.options()
        self.cadence = cadence or Cadence(resolve_cadence(options.policy, options.cadence))
        self.cadence.started = self.started  # uptime counts from here, as the window log's does
        self.forecast = Forecast(
            paths=self.paths,
            fs=self.fs,
            options=options,
            model_dir=config.model_dir,
            cadence=self.cadence,
            state=self.state,
            outbox=self.outbox,
            stop=self.stop,
            started=self.started,
            log=self.log,
        )
        self.housekeeping = Housekeeping(
            paths=self.paths,
            fs=self.fs,
            state=self.state,
            storage=self.storage,
            queue=self.queue,
            current=self.current,
            health=self.health,
            tm_counter=self.outbox.tm_counter,
            outbox=self.outbox,
            final_reports=self.final_reports,
            started=self.started,
        )
        verdicts = Verdicts(self.state, self.storage, self.outbox, self.log)
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
                send=self.outbox.send,
                send_final_report=self.final_reports.send,
                event=self.outbox.event,
                housekeeping=self.housekeeping.message,
                forecast_messages=self.forecast.messages,
                accept=verdicts.accept,
                task_result=task_result,
                task_dir=self.paths.task_dir,
            ),
        )
        self.dispatcher = Dispatcher(
            handlers=self.commands.table(),
            verdicts=verdicts,
            state=self.state,
            health=self.health,
            storage=self.storage,
            queue=self.queue,
            jobs=self.jobs,
            outbox=self.outbox,
            faults=self.faults,
        )
        self.inputs = TaskInputs(
            paths=self.paths,
            fs=self.fs,
            # the payload's other growth on its own disk (a task's stored inputs), gated as checkpoints are
            growth_fs=GatedFS(self.fs, self.storage),
            images=self.images,
            awaited_images=self.awaited_images,
            storage=self.storage,
            outbox=self.outbox,
            log=self.log,
        )
        self.worker = Worker(
            config=config,
            paths=self.paths,
            checkpoint_fs=self.checkpoint_fs,
            cadence=self.cadence,
            stop=self.stop,
            work_available=self.work_available,
            storage=self.storage,
            health=self.health,
            queue=self.queue,
            images=self.images,
            current=self.current,
            inputs=self.inputs,
            outbox=self.outbox,
            faults=self.faults,
            final_reports=self.final_reports,
            housekeeping=self.housekeeping,
            forecast=self.forecast,
            jobs=self.jobs,
            finish_cancel=self.commands.finish_cancel,
            started=self.started,
            log=self.log,
        )

    def handle_packet(self, data: bytes) -> None:
        """A packet from the bus (dispatch.py; main thread, or inline in tests and fuzzers)."""
        self.dispatcher.handle_packet(data)

    def _name_orphaned_tasks(self) -> None:
        """A task directory whose task neither the journal nor the result store knows belongs
        to a task the journal lost: name it. One whose task finished is garbage."""
        root = self.paths.tasks
        orphans = []
        for name in self.fs.listdir(root):
            if self.queue.live(name) is not None:
                continue
            if self.queue.finished(name) is not None:
                shutil.rmtree(self.paths.task_dir(name), ignore_errors=True)
            elif not self.queue.is_lost(name):
                orphans.append(name)
        if orphans:
            best_effort(self.queue.note_lost, orphans)  # named again at the next boot if refused

    # ---- main loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        self.health.arm_crash_record()
        boot = self.state.count_boot()
        # Nothing on this thread waits on the disk from here on (docs/flight.md "Threads"): the
        # boot's own writes -- its count, the telemetry reservation, the window log -- are the
        # command thread's first jobs, so a full, read-only or stalled disk delays none of the
        # first heartbeat, the BOOT event or a PING's answer.
        self.health.defer_saves()
        self.jobs.put(self._boot_writes)
        self.jobs.start(self.housekeeping.tick)
        ctx: zmq.Context = zmq.Context.instance()
        sock = client_socket(ctx, zmq.DEALER, self.layout, "payload", self.config.endpoint)
        self.log.info(
            "flight_booted",
            boot=boot,
            endpoint=self.config.endpoint,
            cadence=self.cadence.mode,  # this payload logs each early record (early_record)
            pending=[t.task_id for t in self.queue.pending()],
            storage=self.storage.condition().state.value,
        )
        self.outbox.send(m.Heartbeat(boot_count=boot, uptime_s=0.0))  # first: the bus learns the boot
        self.forecast.heartbeat_queued.set()
        self.outbox.event(EventId.BOOT, f"payload boot {boot}; {self.queue.depth()} task(s) pending")
        self._boot_events()
        for task in self.queue.unreported():
            self.final_reports.send(task)  # ended before the last cut, but its report never left
        worker = self._worker_thread = threading.Thread(target=self.worker.run_guarded, name=WORKER_THREAD, daemon=True)
        worker.start()
        timers = {"heartbeat": 0.0, "housekeeping": 0.0}
        unsent: list[Outgoing] = []
        try:
            while not self.stop.is_set():
                try:
                    self._loop_once(sock, timers, unsent)
                except Exception as exc:  # noqa: BLE001 - the loop itself never ends on a fault
                    self.faults.fault(EventId.MAIN_LOOP_FAULT, "main loop", exc)
                    self.stop.wait(FAULT_BACKOFF_S)
        finally:
            self.stop.set()
            sock.close(linger=200)
            worker.join(STOP_WAIT_S)  # to the end of its unit of work (the task's StopToken, paused by self.stop)
            if worker.is_alive():
                self.log.warning("worker_busy_at_stop", waited_s=STOP_WAIT_S, task=self.current.snapshot().task)
            self.jobs.join(STOP_WAIT_S)  # a write in progress ends (or the disk is stalled)
            self._final_writes()
        return 0

    def _boot_writes(self) -> None:
        """The boot's own writes, first on the command thread: the boot count (and the replay
        guard with it), the telemetry numbers reserved ahead, the window log."""
        if self.storage.allows_writes():
            try:
                self.state.save()
                self.outbox.tm_counter.reserve([Apid.PAYLOAD])
            except OSError as exc:
                if not self.storage.failed(exc, "saving the boot count"):
                    raise
        self.forecast.start_window_log()

    def _final_writes(self) -> None:
        """At a stop (not a cut): what is still only in memory, if the disk takes it at once."""
        if self.jobs.is_alive():
            return  # stuck on the disk: the process leaves without waiting for it
        try:
            self.health.flush()
            if self.state.unsaved() and self.storage.allows_writes():
                self.state.save()
        except OSError as exc:
            self.log.warning("final_writes_failed", error=str(exc))

    def worker_busy(self) -> bool:
        """Whether the worker thread is still running after run() returned (e.g. inside a weight
        load at the stop): then the caller must leave with os._exit, not through the interpreter's
        shutdown, which aborts with a thread inside torch."""
        return self._worker_thread is not None and self._worker_thread.is_alive()

    def _boot_events(self) -> None:
        event = self.outbox.event
        if self.state.corrupt:
            event(EventId.STATE_CORRUPT, "replay-guard/counter state unreadable; started afresh")
        if self.health.corrupt:
            event(EventId.STATE_CORRUPT, "health and safety state unreadable; abnormal-exit counts started afresh")
        damage = self.queue.journal_damage()
        if damage.tail_bytes:
            event(EventId.UNCLEAN_SHUTDOWN_DETECTED, f"queue journal: dropped a torn tail of {damage.tail_bytes} bytes")
        if damage.records_dropped:
            event(
                EventId.JOURNAL_CORRUPT,
                f"queue journal: skipped {damage.bytes_dropped} damaged bytes in "
                f"{damage.records_dropped} region(s), kept every valid record after them",
            )
        if damage.named or damage.unnamed:
            names = ", ".join(damage.named[:20]) + (" ..." if len(damage.named) > 20 else "")
            unnamed = f"; {damage.unnamed} more could not be named" if damage.unnamed else ""
            event(
                EventId.TASKS_LOST,
                f"{len(damage.named)} task(s) lost to storage damage: {names or '-'}{unnamed}; "
                "LIST_LOST_TASKS lists them, a re-sent one is recognised",
            )

    def _loop_once(self, sock, timers: dict, unsent: list[Outgoing]) -> None:
        """One turn of the main thread: heartbeat and housekeeping from memory, packets out and
        in. Nothing here waits on the disk (a report's bookkeeping once it has left is a job for
        the command thread)."""
        now = time.monotonic()
        if now >= timers["heartbeat"]:
            timers["heartbeat"] = now + HEARTBEAT_S
            self.outbox.send(self.housekeeping.heartbeat(now))
        if now >= timers["housekeeping"]:
            timers["housekeeping"] = now + HOUSEKEEPING_S
            self.outbox.send(self.housekeeping.message())
        self.housekeeping.watch_stall(now)
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
                self.jobs.later(functools.partial(self._after_sent, on_sent))
        received = recv_packet(sock, timeout_s=0.05)
        if received is not None:
            self.dispatcher.handle_packet(received.packet)

    def _after_sent(self, on_sent) -> None:
        try:
            on_sent()
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: the report goes again next boot
            if not self.storage.failed(exc, "recording a sent report"):
                self.faults.fault(EventId.MAIN_LOOP_FAULT, "recording a sent report", exc)


__all__ = ["FlightApp", "FlightConfig", "HEARTBEAT_S", "HOUSEKEEPING_S", "STOP_WAIT_S"]
