"""The onboard process: command dispatch, the inference worker, telemetry.

    main thread    the payload link (ZeroMQ DEALER to the bus): receive telecommands, decode,
                   replay-check, dispatch to one handler per opcode (cFS style: every handler
                   bumps the command or the error counter), send reports, heartbeat, housekeeping
    worker thread  takes the next task from the persistent queue and runs the resumable engine;
                   its progress becomes PUS-1 PROGRESS reports

Everything that must survive a power cut is on disk before it is acknowledged: the replay guard
and counters (state/), the queue journal (queue/), image chunks (images/), each task's
checkpoints (tasks/<id>/). On boot the interrupted task resumes first.
"""
from __future__ import annotations

import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import zmq

from common import log as owlog
from common.durable import DurableFS, is_disk_full
from common.record import Kind, RecordError, decode, encode
from common.wire import (Apid, DurableSequenceCounter, EventId, MessageType, NodeId, ReplayError, ReplayGuard,
                         RequestRef, ResponseCode, TaskPhase, WireError, messages as m)
from common.wire import encode as encode_packet, decode as decode_packet
from common.wire.link import KeyLayout, LinkError, client_socket, recv_packet, send_packet

from .images import ImageStore, content_hash
from .queue import CANCELLED, COMPLETED, FAILED, FINISHED, QUEUED, RUNNING, TaskQueue

MAX_QUEUED = 256
HEARTBEAT_S = 1.0
HOUSEKEEPING_S = 5.0
UNIT_EVENTS = {"vision_block_done": TaskPhase.VISION, "prefill_block_done": TaskPhase.PREFILL,
               "decode_step_done": TaskPhase.DECODE}


class TaskCancelled(Exception):
    pass


@dataclass
class Counters:
    boot_count: int = 0
    command_count: int = 0
    error_count: int = 0


class PersistentState:
    """Boot count, command/error counters and the replay guard, in one record (atomic replace)."""

    def __init__(self, directory: str, fs: DurableFS):
        self.fs, self.path = fs, os.path.join(directory, "state.rec")
        fs.makedirs(directory)
        self.counters, self.guard, self.corrupt = Counters(), ReplayGuard(), False
        if fs.exists(self.path):
            try:
                rec, _ = decode(fs.read(self.path), expect_kind=Kind.GUARD_STATE)
                self.counters = Counters(**rec.meta["counters"])
                self.guard = ReplayGuard.from_bytes(bytes(rec.meta["guard"]))
            except (RecordError, KeyError, TypeError, ValueError):
                self.corrupt = True  # start a fresh guard; reported as STATE_CORRUPT

    def save(self) -> None:
        meta = {"counters": self.counters.__dict__, "guard": self.guard.to_bytes()}
        self.fs.write_atomic(self.path, encode(Kind.GUARD_STATE, meta).chunks)


class FlightApp:
    def __init__(self, data_dir: str, model_dir: str, keys_dir: str, endpoint: str, engine_options,
                 device: str | None = None, dtype: str | None = None, fs: DurableFS | None = None,
                 weight_read_hook=None, cadence=None):
        self.fs = fs or DurableFS()
        self.data_dir = os.path.abspath(data_dir)
        self.model_dir = model_dir
        self.endpoint = endpoint
        self.layout = KeyLayout(Path(keys_dir))
        self.options = engine_options
        self.device, self.dtype = device, dtype
        self.weight_read_hook = weight_read_hook
        self.log = owlog.get(component="flight")
        self.state = PersistentState(os.path.join(self.data_dir, "state"), self.fs)
        self.queue = TaskQueue(os.path.join(self.data_dir, "queue"), self.fs)
        self.images = ImageStore(os.path.join(self.data_dir, "images"), self.fs)
        self.tm_counter = DurableSequenceCounter(os.path.join(self.data_dir, "state", "tm-sequence.bin"))
        self.outbox: queue.Queue[bytes] = queue.Queue()
        self.started = time.monotonic()
        self.current = {"task": None, "phase": None, "done": 0, "total": 0}
        self.stop = threading.Event()
        self.work_available = threading.Event()
        self.cancel_requested: set[str] = set()
        self.engine = None
        self._engine_lock = threading.Lock()
        # Checkpoint cadence: fed with warnings, bus telemetry and the windows lived through
        # (flight/checkpoint/cadence.py); shared by every task of this boot.
        from flight.checkpoint.cadence import Cadence, WindowLog

        self.cadence = cadence or Cadence(getattr(engine_options, "cadence", "fixed"))
        self.cadence.started = self.started  # uptime counts from here, as the window log's does
        self.windows = WindowLog(os.path.join(self.data_dir, "state"), started=self.started)
        self.handlers = {
            MessageType.PING: self.on_ping, MessageType.STATUS: self.on_status,
            MessageType.UPLINK_TASK: self.on_uplink_task, MessageType.CANCEL_TASK: self.on_cancel_task,
            MessageType.SET_PRIORITY: self.on_set_priority, MessageType.DOWNLINK_RESULT: self.on_downlink_result,
            MessageType.IMAGE_CHUNK: self.on_image_chunk, MessageType.IMAGE_QUERY: self.on_image_query,
            MessageType.SHUTDOWN_WARNING: self.on_shutdown_warning, MessageType.POWER_STATE: self.on_power_state,
        }

    # ---- outbound ------------------------------------------------------------------------------
    def send(self, message: m.Message, on_sent=None) -> None:
        """Queue a telemetry packet (thread-safe; the main thread sends). `on_sent` runs once the
        packet has left for the bus."""
        packet = encode_packet(message, Apid.PAYLOAD, self.tm_counter.next(Apid.PAYLOAD), source_id=NodeId.PAYLOAD)
        self.outbox.put((packet, on_sent))

    def send_final_report(self, task) -> None:
        """COMPLETED (+ TASK_RESULT) or FAILED for a finished task; once it has left, the journal
        records it as reported. A cut before that makes the next boot send it again, so the ground
        always hears how a task ended."""
        request = RequestRef(*task.request)
        mark = lambda: self.queue.mark_reported(task.task_id)  # noqa: E731
        if task.state == COMPLETED:
            self.send(m.Completed.about(request, task_id=task.task_id))
            self.send(self._task_result(task), on_sent=mark)
        else:
            code = ResponseCode.CANCELLED if task.state == CANCELLED else ResponseCode(task.code or ResponseCode.INTERNAL_ERROR)
            self.send(m.Failed.about(request, task_id=task.task_id, code=code, reason=task.reason[:400] or task.state),
                      on_sent=mark)

    def event(self, event_id: EventId, text: str, task_id: str | None = None) -> None:
        self.log.info("event", event_id=event_id.name, text=text, task_id=task_id)
        self.send(m.Event(event_id=event_id, text=text[:500], task_id=task_id))

    def housekeeping(self) -> m.Housekeeping:
        c = self.state.counters
        try:
            free = shutil.disk_usage(self.data_dir).free
        except OSError:
            free = 0
        return m.Housekeeping(queue_depth=self.queue.depth(), current_task=self.current["task"],
                              phase=self.current["phase"], progress_done=self.current["done"],
                              progress_total=self.current["total"], checkpoint_bytes=self._checkpoint_bytes(),
                              disk_free_bytes=free, boot_count=c.boot_count, command_count=c.command_count,
                              error_count=c.error_count, uptime_s=time.monotonic() - self.started)

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

    # ---- dispatch ----------------------------------------------------------------------------------
    def handle_packet(self, data: bytes) -> None:
        try:
            header, message = decode_packet(data)
        except WireError as err:
            self._reject(m.Rejected.from_error(err), err.code)
            return
        if not message.is_command():
            if isinstance(message, (m.ShutdownWarning, m.PowerStateChange)):
                self.handlers[message.TYPE](header, message)
            elif isinstance(message, m.ThermalReport):
                self.cadence.thermal(message.trace_time_s, message.payload_temp_c)
            elif isinstance(message, m.PowerReport):
                self.cadence.power(message.trace_time_s, message.battery_soc)
            return
        request = header.request
        try:
            self.state.guard.accept(request.apid, request.source_id, request.seq)
        except ReplayError as err:
            self.event(EventId.REPLAY_DETECTED, f"replayed {MessageType(request.message_type).name} seq {request.seq}")
            self._reject(m.Rejected.from_error(err, request), ResponseCode.REPLAYED_SEQUENCE)
            return
        handler = self.handlers.get(message.TYPE)
        try:
            if handler is None:
                raise WireError(ResponseCode.UNKNOWN_COMMAND, f"no handler for {message.TYPE.name}")
            handler(request, message)
        except WireError as err:
            self._reject(m.Rejected.from_error(err, request, getattr(message, "task_id", None)), err.code)
            return
        except OSError as exc:
            code = ResponseCode.STORAGE_FULL if is_disk_full(exc) else ResponseCode.INTERNAL_ERROR
            self._reject(m.Rejected.about(request, code=code, reason=f"{type(exc).__name__}: {exc}"[:400]), code)
            return

    def _accept(self, request: RequestRef, **fields) -> None:
        """The command is valid: count it, persist guard + counters, then acknowledge."""
        self.state.counters.command_count += 1
        self.state.save()
        self.send(m.Accepted.about(request, **fields))

    def _reject(self, report: m.Rejected, code: ResponseCode) -> None:
        self.state.counters.error_count += 1
        try:
            self.state.save()
        except OSError:
            pass  # a full disk must not stop us from answering
        self.log.warning("command_rejected", code=ResponseCode(code).name, reason=report.reason)
        self.send(report)

    # ---- handlers ------------------------------------------------------------------------------------
    def on_ping(self, request, msg: m.Ping) -> None:
        self._accept(request)
        self.send(m.Pong(key=msg.key))
        self.send(m.Completed.about(request))

    def on_status(self, request, msg) -> None:
        self._accept(request)
        self.send(self.housekeeping())
        self.send(m.Completed.about(request))

    def on_uplink_task(self, request, msg: m.UplinkTask) -> None:
        digest = content_hash(msg.prompt, list(msg.images), msg.max_new_tokens)
        existing = self.queue.get(msg.task_id)
        if existing is not None:
            if existing.content_hash != digest:
                raise WireError(ResponseCode.DUPLICATE_TASK, f"task {msg.task_id} exists with other content")
            self._accept(request, task_id=msg.task_id)  # the same uplink again: idempotent
            return
        if self.queue.depth() >= MAX_QUEUED:
            raise WireError(ResponseCode.QUEUE_FULL, f"{MAX_QUEUED} tasks queued")
        self.queue.submit(msg.task_id, msg.prompt, list(msg.images), msg.max_new_tokens, msg.priority,
                          (request.apid, request.source_id, request.seq, request.message_type), digest)
        self._accept(request, task_id=msg.task_id)
        self.event(EventId.TASK_QUEUED, f"task {msg.task_id} queued (priority {msg.priority})", msg.task_id)
        self.send(self.housekeeping())
        self.work_available.set()

    def _unfinished_task(self, task_id: str):
        task = self.queue.get(task_id)
        if task is None:
            raise WireError(ResponseCode.UNKNOWN_TASK, f"no task {task_id}")
        if task.state in FINISHED:
            raise WireError(ResponseCode.TASK_FINISHED, f"task {task_id} is {task.state}")
        return task

    def on_cancel_task(self, request, msg: m.CancelTask) -> None:
        task = self._unfinished_task(msg.task_id)
        self._accept(request, task_id=msg.task_id)
        if task.state == RUNNING and self.current["task"] == msg.task_id:
            self.cancel_requested.add(msg.task_id)  # the worker stops at the next unit of work
        else:
            self._finish_cancel(task)
        self.send(m.Completed.about(request, task_id=msg.task_id))

    def _finish_cancel(self, task) -> None:
        self.queue.cancel(task.task_id, code=int(ResponseCode.CANCELLED))
        self.send_final_report(self.queue.get(task.task_id))
        self.event(EventId.TASK_CANCELLED, f"task {task.task_id} cancelled", task.task_id)
        shutil.rmtree(self._task_dir(task.task_id), ignore_errors=True)

    def on_set_priority(self, request, msg: m.SetPriority) -> None:
        self._unfinished_task(msg.task_id)
        self.queue.set_priority(msg.task_id, msg.priority)
        self._accept(request, task_id=msg.task_id)
        self.send(m.Completed.about(request, task_id=msg.task_id))

    def on_downlink_result(self, request, msg: m.DownlinkResult) -> None:
        task = self.queue.get(msg.task_id)
        if task is None:
            raise WireError(ResponseCode.UNKNOWN_TASK, f"no task {msg.task_id}")
        if task.state in (FAILED, CANCELLED):
            # Finished without a result: say why, so a waiting ground stops waiting.
            code = ResponseCode.CANCELLED if task.state == CANCELLED else ResponseCode(task.code or ResponseCode.TASK_FINISHED)
            raise WireError(code, f"task {msg.task_id} {task.state}: {task.reason}"[:400])
        if task.state != COMPLETED:
            raise WireError(ResponseCode.RESULT_NOT_READY, f"task {msg.task_id} is {task.state}")
        self._accept(request, task_id=msg.task_id)
        self.send(self._task_result(task))
        self.send(m.Completed.about(request, task_id=msg.task_id))

    def _task_result(self, task) -> m.TaskResult:
        r = task.result
        return m.TaskResult(task_id=task.task_id, token_ids=list(r["token_ids"]), text=r["text"][:30000],
                            logits_sha256=bytes.fromhex(r["logits_sha256"]),
                            timings={k: float(v) for k, v in r.get("timings", {}).items()},
                            interruptions=task.interruptions)

    def on_image_chunk(self, request, msg: m.ImageChunk) -> None:
        try:
            completed = self.images.put_chunk(msg)
        except WireError as err:
            if err.code in (ResponseCode.FILE_HASH_MISMATCH, ResponseCode.IMAGE_UNDECODABLE, ResponseCode.IMAGE_TOO_LARGE):
                self.event(EventId.IMAGE_REJECTED, f"image {msg.image}: {err.reason}")
            raise
        self._accept(request)
        if completed:
            self.event(EventId.IMAGE_COMPLETE, f"image {msg.image} verified ({msg.image_size} bytes)")
            self.work_available.set()

    def on_image_query(self, request, msg: m.ImageQuery) -> None:
        self._accept(request)
        self.send(self.images.status(msg.image))
        self.send(m.Completed.about(request))

    def on_shutdown_warning(self, header, msg: m.ShutdownWarning) -> None:
        self.event(EventId.SHUTDOWN_WARNING_RECEIVED, f"bus warns of a cut in {msg.lead_time_s:.1f} s ({msg.cause})")
        self.cadence.warning(msg.lead_time_s)
        if self.engine is not None:
            self.engine.checkpoint_soon.set()

    def on_power_state(self, header, msg) -> None:
        self.log.info("power_state", **{k: str(v) for k, v in msg.pack().items()})

    # ---- worker ----------------------------------------------------------------------------------------
    def _task_dir(self, task_id: str) -> str:
        return os.path.join(self.data_dir, "tasks", task_id)

    def _next_runnable(self):
        for task in self.queue.pending():
            if all(self.images.is_verified(name) for name in task.images):
                return task
        return None

    def worker(self) -> None:
        # The engine's libraries load here, behind a link that is already up (run()).
        import torch

        if getattr(self.options, "threads", None):
            torch.set_num_threads(self.options.threads)  # before any tensor op: pinned per request
        from flight.engine import Engine
        from flight.model.inputs import InputError
        from flight.model.loader import load_model

        model = load_model(self.model_dir, device=self.device, dtype=self.dtype, read_hook=self.weight_read_hook,
                           lazy_processors=True)
        while not self.stop.is_set():
            task = self._next_runnable()
            if task is None:
                self.current.update(task=None, phase=None, done=0, total=0)
                self.work_available.wait(0.5)
                self.work_available.clear()
                continue
            resumed = task.state == RUNNING
            self.queue.start(task.task_id)
            request = RequestRef(*task.request)
            self.current.update(task=task.task_id, phase=TaskPhase.RECOVERING if resumed else TaskPhase.VISION,
                                done=0, total=0)
            self.send(m.Started.about(request, task_id=task.task_id))
            self.event(EventId.TASK_RESUMED if resumed else EventId.TASK_STARTED,
                       f"task {task.task_id} {'resumed after ' + str(task.interruptions) + ' cut(s)' if resumed else 'started'}",
                       task.task_id)
            try:
                inputs = self._task_inputs(task, model)
                engine = Engine(model, self.options, fs=self.fs, events=self._engine_events(task, request),
                                cadence=self.cadence)
                self.engine = engine
                t0 = time.monotonic()
                result = engine.run(inputs, os.path.join(self._task_dir(task.task_id), "ckpt"), task.max_new_tokens)
            except TaskCancelled:
                self.cancel_requested.discard(task.task_id)
                self._finish_cancel(task)
                continue
            except InputError as exc:
                self._fail(task, request, ResponseCode.IMAGE_UNDECODABLE, str(exc))
                continue
            except Exception as exc:  # a failed task must not stop the payload
                self.log.exception("task_failed", task_id=task.task_id)
                code = ResponseCode.STORAGE_FULL if is_disk_full(exc) else ResponseCode.INFERENCE_ERROR
                self._fail(task, request, code, f"{type(exc).__name__}: {exc}")
                continue
            finally:
                self.engine = None
            timings = dict(result.phase_seconds)
            timings["total_this_boot"] = time.monotonic() - t0
            self.queue.complete(task.task_id, {"token_ids": result.token_ids, "text": result.text,
                                               "logits_sha256": result.logits_sha256(), "timings": timings,
                                               "bytes_written": result.bytes_written})
            self._drop_inputs(task.task_id)
            self.current.update(phase=TaskPhase.COMPLETED)
            self.event(EventId.TASK_COMPLETED, f"task {task.task_id} completed: {len(result.token_ids)} tokens, "
                                               f"{task.interruptions} cut(s) survived", task.task_id)
            self.send_final_report(self.queue.get(task.task_id))
            self.send(self.housekeeping())  # the queue changed: say so at once

    def _inputs_path(self, task_id: str) -> str:
        return os.path.join(self._task_dir(task_id), "inputs.rec")

    def _task_inputs(self, task, model):
        """The task's preprocessed inputs: built (tokenizer, image decoding and processing) at its
        first start and stored (TASK_INPUTS, docs/record-format.md), read back on every later
        boot -- a resumed task needs no tokenizer, image processor or PIL before its last step."""
        from flight.model.config import processors_hash
        from flight.model.inputs import build_inputs, load_image, load_inputs, save_inputs

        path = self._inputs_path(task.task_id)
        key = {"task": task.content_hash, "model": model.content_hash, "processors": processors_hash(model.model_dir)}
        inputs, why = load_inputs(self.fs, path, key)
        if inputs is not None:
            return inputs
        if why is not None:
            self.log.warning("task_inputs_rebuilt", task_id=task.task_id, reason=why)
        images = [load_image(self.images.image_path(n)) for n in task.images]
        inputs = build_inputs(model.tokenizer, model.image_processor, images, task.prompt, model.adapter.image_token_id)
        try:
            self.fs.makedirs(self._task_dir(task.task_id))
            save_inputs(self.fs, path, inputs, key)
        except OSError as exc:  # a full disk costs the shortcut, not the task
            if not is_disk_full(exc):
                raise
            self.log.warning("task_inputs_not_stored", task_id=task.task_id, reason=str(exc.strerror))
        return inputs

    def _drop_inputs(self, task_id: str) -> None:
        try:
            os.remove(self._inputs_path(task_id))
        except OSError:
            pass  # gone already, or left for the next boot to find finished

    def _fail(self, task, request, code: ResponseCode, reason: str) -> None:
        self.queue.fail(task.task_id, code, reason)
        self.send_final_report(self.queue.get(task.task_id))
        self.event(EventId.TASK_FAILED, f"task {task.task_id} failed: {code.name}", task.task_id)

    def _engine_events(self, task, request):
        last_sent = {"t": 0.0}

        def on_event(name, **fields):
            if name == "request_opened":
                phase = fields.get("phase")
                if phase not in (None, "start"):
                    self.event(EventId.RECOVERY_PLANNED, f"task {task.task_id} resumes in {phase} at "
                                                         f"{fields.get('position')}", task.task_id)
            elif name == "manifest_mismatch":
                self.event(EventId.CHECKPOINT_MANIFEST_MISMATCH, f"task {task.task_id}: checkpoints from another "
                                                                 f"configuration, restarting", task.task_id)
            elif name == "record_rejected":
                self.event(EventId.CHECKPOINT_CORRUPT, f"task {task.task_id}: rejected {fields.get('file')} "
                                                       f"({fields.get('reason')})", task.task_id)
            elif name == "checkpoint_write_failed":
                self.event(EventId.DISK_FULL, f"task {task.task_id}: checkpoint {fields.get('record')} skipped "
                                              f"({fields.get('reason')})", task.task_id)
            phase = UNIT_EVENTS.get(name)
            if phase is None:
                return
            if task.task_id in self.cancel_requested:
                raise TaskCancelled(task.task_id)
            if phase == TaskPhase.VISION:
                done, total = fields["block"], fields["of"]
            elif phase == TaskPhase.PREFILL:
                done, total = fields["done"], fields["of"]
            else:
                done, total = fields["step"], fields["of"]
            changed = phase != self.current["phase"]
            self.current.update(phase=phase, done=done, total=total)
            now = time.monotonic()
            if changed or done == total or now - last_sent["t"] > 0.1:
                last_sent["t"] = now
                self.send(m.Progress.about(request, task_id=task.task_id, phase=phase, done=done, total=total))

        return on_event

    # ---- main loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        self.state.counters.boot_count += 1
        self.state.save()
        self._start_window_log()
        ctx = zmq.Context.instance()
        sock = client_socket(ctx, zmq.DEALER, self.layout, "payload", self.endpoint)
        self.log.info("flight_booted", boot=self.state.counters.boot_count, endpoint=self.endpoint,
                      pending=[t.task_id for t in self.queue.pending()])
        self.send(m.Heartbeat(boot_count=self.state.counters.boot_count, uptime_s=0.0))  # first: the bus learns the boot
        self.event(EventId.BOOT, f"payload boot {self.state.counters.boot_count}; "
                                 f"{self.queue.depth()} task(s) pending")
        if self.state.corrupt:
            self.event(EventId.STATE_CORRUPT, "replay-guard/counter state unreadable; started afresh")
        if self.queue.recovered_bytes_dropped:
            self.event(EventId.UNCLEAN_SHUTDOWN_DETECTED,
                       f"queue journal: dropped a torn tail of {self.queue.recovered_bytes_dropped} bytes")
        for task in self.queue.unreported():
            self.send_final_report(task)  # ended before the last cut, but its report never left
        worker = threading.Thread(target=self._worker_guarded, name="inference-worker", daemon=True)
        worker.start()
        next_heartbeat = next_hk = 0.0
        unsent: list[tuple[bytes, object]] = []
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if now >= next_heartbeat:
                    next_heartbeat = now + HEARTBEAT_S
                    self.send(m.Heartbeat(boot_count=self.state.counters.boot_count, uptime_s=now - self.started,
                                          current_task=self.current["task"], phase=self.current["phase"]))
                if now >= next_hk:
                    next_hk = now + HOUSEKEEPING_S
                    self.send(self.housekeeping())
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
                        on_sent()
                received = recv_packet(sock, timeout_s=0.05)
                if received is not None:
                    self.handle_packet(received.packet)
        finally:
            self.stop.set()
            sock.close(linger=200)
        return 0

    def _start_window_log(self) -> None:
        """Log the window the last boot lived through and keep this one's length on disk."""
        try:
            self.cadence.set_windows(self.windows.open(self.state.counters.boot_count))
        except OSError as exc:  # the history is advice: without it the cadence is the fixed one
            self.log.warning("window_log_unavailable", error=str(exc))
            return
        threading.Thread(target=self.windows.keep_marking, args=(self.stop,), name="window-log", daemon=True).start()

    def _worker_guarded(self) -> None:
        try:
            self.worker()
        except Exception:
            self.log.exception("worker_crashed")
            self.event(EventId.FATAL_ERROR, "inference worker crashed; restarting the payload process")
            time.sleep(0.5)
            os._exit(70)  # let the bus's heartbeat watchdog / respawn bring us back clean
