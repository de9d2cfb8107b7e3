"""The inference worker thread: loads the model once, takes the next runnable task from the
persistent queue and runs the resumable engine on it; the engine's progress becomes PUS-1
PROGRESS reports, its outcome COMPLETED (+ TASK_RESULT), FAILED or CANCELLED.

A run ends early only through its `StopToken` (flight/events.py): a CANCEL_TASK cancels it
(through `CurrentWork`), the process's stop pauses it, and an image found damaged when the
engine asks for it makes the engine end the run AWAITING_INPUTS. Each is a status returned by
`Engine.run_or_stop`; nothing is raised through the engine for it.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from common.durable import DurableFS, storage_condition
from common.imagecheck import ProcessorLimits
from common.wire import EventId, ResponseCode, TaskPhase
from common.wire import messages as m
from flight.checkpoint.cadence import Cadence
from flight.events import UNIT_DONE, EngineEvent, RunStatus, StopToken

from .config import DataPaths, FlightConfig
from .current import CurrentWork
from .forecast import Forecast
from .health import ENGINE_ITEM, WORKER, Health, task_item
from .housekeeping import Housekeeping
from .images import ImageStore
from .inputs import TaskInputs
from .jobs import CommandJobs
from .outbox import Outbox
from .queue import RUNNING, TaskQueue
from .reports import FAULT_EVENT_EVERY_S, Faults, FinalReports
from .storage import Storage

#: Pause after an unexpected fault in a loop, so a fault that repeats cannot spin the CPU.
FAULT_BACKOFF_S = 0.5
#: Pause between attempts to load the engine when it fails.
ENGINE_RETRY_S = 10.0
#: How often a missing or unreadable model directory is looked for again.
MODEL_RECHECK_S = 2.0
#: The wire's phase of each unit of work (flight/events.py UNIT_DONE).
UNIT_EVENTS = {
    EngineEvent.VISION_BLOCK_DONE: TaskPhase.VISION,
    EngineEvent.PREFILL_BLOCK_DONE: TaskPhase.PREFILL,
    EngineEvent.DECODE_STEP_DONE: TaskPhase.DECODE,
}
assert set(UNIT_EVENTS) == UNIT_DONE


class Worker:
    """The worker thread's loop and one task's run, handed what they use."""

    def __init__(
        self,
        *,
        config: FlightConfig,
        paths: DataPaths,
        checkpoint_fs: DurableFS,
        cadence: Cadence,
        stop: threading.Event,
        work_available: threading.Event,
        storage: Storage,
        health: Health,
        queue: TaskQueue,
        images: ImageStore,
        current: CurrentWork,
        inputs: TaskInputs,
        outbox: Outbox,
        faults: Faults,
        final_reports: FinalReports,
        housekeeping: Housekeeping,
        forecast: Forecast,
        jobs: CommandJobs,
        finish_cancel: Callable[[Any], None],
        started: float,
        log: Any,
    ):
        self.config = config
        self.paths = paths
        self.checkpoint_fs = checkpoint_fs
        self.cadence = cadence
        self.stop = stop
        self.work_available = work_available
        self.storage = storage
        self.health = health
        self.queue = queue
        self.images = images
        self.current = current
        self.inputs = inputs
        self.outbox = outbox
        self.faults = faults
        self.final_reports = final_reports
        self.housekeeping = housekeeping
        self.forecast = forecast
        self.jobs = jobs
        self.finish_cancel = finish_cancel
        self.started = started
        self.log = log
        self._disk_full_reported_at = -1e9  # worker thread only

    # ---- the thread ------------------------------------------------------------------------------
    def run_guarded(self) -> None:
        """The worker catches everything itself; this is the last line, which keeps the process
        (and its command handling) alive if something escapes anyway."""
        while not self.stop.is_set():
            try:
                self.run()
                return
            except BaseException as exc:  # noqa: BLE001
                self.faults.fault(EventId.FATAL_ERROR, "inference worker", exc)
                self.stop.wait(ENGINE_RETRY_S)

    def run(self) -> None:
        model = self.load_engine()
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
                self.current.set_engine(None)
                if self.storage.failed(exc, f"task {task.task_id}" if task else "worker"):
                    # The disk, not the task: nothing counted, the task stays queued and runs
                    # again once the storage state allows (work_available is set then).
                    self.stop.wait(FAULT_BACKOFF_S)
                    continue
                self.faults.fault(
                    EventId.WORKER_FAULT,
                    f"worker failed{f' on task {task.task_id}' if task else ''}",
                    exc,
                    task_item(task.task_id) if task else None,
                )
                self.stop.wait(FAULT_BACKOFF_S)

    def _next_runnable(self) -> Any:
        if not self.storage.allows_writes():
            return None  # a task's start and end are writes: none starts until the disk takes them
        if self.health.unsaved():
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

    # ---- the model -------------------------------------------------------------------------------
    def load_engine(self) -> Any:
        """The model, loaded once. Every boot-time fault of the engine counts against `engine:load`
        like any item: the imports of torch and the loader run inside its handling, so a boot that
        dies there (the OOM killer during `import torch`) is counted by the next one, and a load
        that raises is a fault (an event each time, retried); at EXIT_BOUND it is quarantined and
        the payload answers commands without running tasks. A model directory that is missing or
        unreadable is the environment's doing, not the engine's: it is reported (BOOT_FAULT, once
        per problem), never counted, and looked for again every MODEL_RECHECK_S."""
        config = self.config
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
            if self.health.unsaved() and self.storage.allows_writes():
                # The bus's verdict has just counted the last boot's load, in memory: the command
                # thread saves it at its next tick. Loading before then, a load that kills (the OOM
                # killer in `import torch`) would erase the count with this boot and never reach the
                # quarantine: a boot loop. (A disk that takes no writes cannot keep the count anyway;
                # the bus's boot-loop guard stands there, and the load itself writes nothing.)
                self.stop.wait(0.05)
                continue
            problem = self._model_problem()
            if problem is not None:
                if problem != model_problem:
                    self.outbox.event(
                        EventId.BOOT_FAULT,
                        f"{problem}; the payload answers commands and runs no task until it is there "
                        f"(looked for every {MODEL_RECHECK_S:g} s)",
                    )
                model_problem = problem
                self.stop.wait(MODEL_RECHECK_S)
                continue
            if model_problem is not None:
                self.log.info("model_found", model=config.model_dir, was=model_problem)
                # read at boot without it; the main thread verifies uploads with them meanwhile,
                # so they are handed over under the image store's lock, not assigned into it
                self.images.set_limits(ProcessorLimits.of_model_dir(config.model_dir))
                model_problem = None
            try:
                with self.health.handling(ENGINE_ITEM, WORKER):
                    # lazy: torch/transformers (seconds), behind a link that is already up (FlightApp.run)
                    import torch

                    threads = config.engine_options.threads if config.engine_options is not None else None
                    if threads:
                        torch.set_num_threads(threads)  # before any tensor op: pinned per request
                    import flight.engine  # noqa: F401  (what _run_task imports: its cost is the load's)
                    from flight.model.loader import load_model

                    model = load_model(
                        config.model_dir,
                        device=config.device,
                        dtype=config.dtype,
                        read_hook=config.weight_read_hook,
                        lazy_processors=True,
                    )
                # Loaded: whatever killed a load before is behind it, as a unit of work is for a
                # task (else OOM kills during loads months apart would add up to a quarantine).
                self.health.progress(ENGINE_ITEM)
                return model
            except Exception as exc:  # noqa: BLE001 - MemoryError and ImportError included
                self.faults.fault(EventId.WORKER_FAULT, "engine load failed", exc, ENGINE_ITEM)
                self.stop.wait(ENGINE_RETRY_S)
        return None

    def _model_problem(self) -> str | None:
        """What keeps the model directory from being loaded, in words, or None. Plain file checks
        (no torch): config.json names a supported architecture and weight files are there."""
        from flight.model.config import ModelError, read_model_type, weight_files

        model_dir = self.config.model_dir
        try:
            read_model_type(model_dir)
            if not weight_files(model_dir):
                return f"no weight files (*.safetensors) in model directory {model_dir}"
        except ModelError as exc:
            return f"model unavailable: {exc}"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"model directory {model_dir} unreadable: {type(exc).__name__}: {exc}"
        return None

    # ---- one task --------------------------------------------------------------------------------
    def _run_task(self, model, task) -> None:
        # lazy: torch/transformers (seconds): the payload answers the bus first (0.5 s budget)
        from flight.engine import Engine
        from flight.model.inputs import InputError

        item = task_item(task.task_id)
        with self.health.handling(item, WORKER):
            inputs = self.inputs.stored(task, model)
            # Images are read (and re-verified) only when the inputs must be built from them.
            contents = self.inputs.images_of(task) if inputs is None else None
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
            self.outbox.send(m.Started.about(request, task_id=task.task_id))
            self.forecast.profile.task_started(time.monotonic())
            self.outbox.event(
                EventId.TASK_RESUMED if resumed else EventId.TASK_STARTED,
                f"task {task.task_id} "
                f"{'resumed after ' + str(task.interruptions) + ' cut(s)' if resumed else 'started'}",
                task.task_id,
            )
            try:
                if inputs is None:
                    assert contents is not None  # read above whenever there are no stored inputs
                    inputs = self.inputs.build(task, model, contents)
                    del contents
                engine = Engine(
                    model,
                    self.config.engine_options,
                    fs=self.checkpoint_fs,
                    events=self._engine_events(task, request, stop),
                    cadence=self.cadence,
                )
                self.current.set_engine(engine)
                t0 = time.monotonic()
                run = engine.run_or_stop(
                    inputs, self.paths.join("tasks", task.task_id, "ckpt"), task.max_new_tokens, stop
                )
            except InputError as exc:
                self._fail(task, exc.code, str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a failed task must not stop the payload
                if storage_condition(exc) is not None:
                    raise  # the disk, not the task: the worker waits it out (never a failure)
                self.log.exception("task_failed", task_id=task.task_id)
                self._fail(task, ResponseCode.INFERENCE_ERROR, f"{type(exc).__name__}: {exc}")
                return
            finally:
                self.current.set_engine(None)
            if run.status == RunStatus.AWAITING_INPUTS:
                return  # an image was found damaged and removed: the task runs again once it is resent
            if run.status == RunStatus.CANCELLED:
                self.current.cancel_done(task.task_id)
                self._until_stored(lambda: self.finish_cancel(task), f"cancelling task {task.task_id}")
                return
            if run.status == RunStatus.PAUSED:
                self.log.info("task_paused_for_stop", task_id=task.task_id)
                return
            result = run.result
            assert result is not None  # FINISHED
            timings = dict(result.phase_seconds)
            timings["total_this_boot"] = time.monotonic() - t0
            self.forecast.profile.task_ended(task.max_new_tokens)
            self.jobs.put(self.forecast.send_profile)
            outcome = {
                "token_ids": result.token_ids,
                "text": result.text,
                "logits_sha256": result.logits_sha256(),
                "timings": timings,
                "bytes_written": result.bytes_written,
                # each restart (seconds to find where to resume, phase, planner) and the bytes of
                # checkpoint records over every boot: the engine keeps both in the task's records
                "recoveries": [[e["restore_s"], e["phase"], e["planner"]] for e in result.recoveries],
                "lifetime_bytes_written": result.lifetime_bytes_written,
            }
            # The answer exists only in memory until this write: held there, not recomputed,
            # while the disk refuses it (a cut meanwhile resumes from the checkpoints).
            if not self._until_stored(lambda: self.queue.complete(task.task_id, outcome), f"task {task.task_id}"):
                return
        shutil.rmtree(
            self.paths.task_dir(task.task_id), ignore_errors=True
        )  # finished and durable: checkpoints and inputs go
        self.current.set_phase(TaskPhase.COMPLETED)
        self.outbox.event(
            EventId.TASK_COMPLETED,
            f"task {task.task_id} completed: {len(result.token_ids)} tokens, {task.interruptions} cut(s) survived",
            task.task_id,
        )
        self.final_reports.send(self.queue.get(task.task_id))
        self.outbox.send(self.housekeeping.message())  # the queue changed: say so at once

    def _until_stored(self, store: Callable[[], object], what: str) -> bool:
        """Run `store` (a durable write of the worker's) until the disk takes it: a storage
        condition is reported and waited out, never charged to the task. False if the payload
        stops first (the task then stays as it is on disk, and the next boot takes it up)."""
        while True:
            try:
                store()
                return True
            except OSError as exc:
                if not self.storage.failed(exc, what):
                    raise
            if self.stop.wait(1.0):
                return False

    def _fail(self, task, code: ResponseCode, reason: str) -> None:
        if not self._until_stored(lambda: self.queue.fail(task.task_id, code, reason), f"task {task.task_id}"):
            return
        self.final_reports.send(self.queue.get(task.task_id))
        self.outbox.event(EventId.TASK_FAILED, f"task {task.task_id} failed: {ResponseCode(code).name}", task.task_id)

    def _engine_events(self, task, request, stop: StopToken):
        last_sent = {"t": 0.0}
        item = task_item(task.task_id)
        event = self.outbox.event

        def on_event(name: EngineEvent, **fields: Any) -> None:
            if name == EngineEvent.REQUEST_OPENED:
                phase = fields.get("phase")
                if phase not in (None, "start"):
                    event(
                        EventId.RECOVERY_PLANNED,
                        f"task {task.task_id} resumes in {phase} at {fields.get('position')}",
                        task.task_id,
                    )
            elif name == EngineEvent.MANIFEST_MISMATCH:
                event(
                    EventId.CHECKPOINT_MANIFEST_MISMATCH,
                    f"task {task.task_id}: checkpoints from another configuration, restarting",
                    task.task_id,
                )
            elif name == EngineEvent.RECORD_REJECTED:
                event(
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
                    event(
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
            self.forecast.profile.unit(str(phase), done, total, now, now - self.started)
            if changed:  # kept at each phase change: a cut must not take a window's measurements with it
                self.jobs.put(self.forecast.save_profile)
            if changed or done == total or now - last_sent["t"] > 0.1:
                last_sent["t"] = now
                self.outbox.send(m.Progress.about(request, task_id=task.task_id, phase=phase, done=done, total=total))

        return on_event


__all__ = ["ENGINE_RETRY_S", "FAULT_BACKOFF_S", "MODEL_RECHECK_S", "UNIT_EVENTS", "Worker"]
