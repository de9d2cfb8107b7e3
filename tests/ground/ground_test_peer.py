"""ScriptedBusPayloadPeer: a TEST PEER standing in for `ow bus run` + `ow flight run`, so the
ground tools can be tested alone, over real ZeroMQ + CurveZMQ on 127.0.0.1.

It binds the bus's commands ROUTER and telemetry PUB (CURVE server, authenticator reading
`authorized/`), checks every telecommand like the payload does (decode, replay guard), and
implements just enough payload behaviour: an image chunk store answering IMAGE_QUERY with
IMAGE_STATUS bitmaps, a task table (idempotent UPLINK_TASK, DUPLICATE_TASK), tasks that finish
after a scripted delay, results, cancel, priority, housekeeping. Like the bus it answers on the
sender's connection and publishes every report on the PUB as well.

Scripted faults: a payload power cut after N stored chunks or just before a command type
(packets the payload had received but not handled are lost; while off, the bus stores commands
and forwards them at power-up, or with `store_while_off=False` they are lost as on a dropped
link), a bus restart on the N-th chunk packet (that packet, queued packets and routing ids lost;
sockets closed and rebound), a payload that never answers, one-shot rejections by the payload
or by the bus.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
from collections import Counter

import zmq

from common.wire import (
    Apid,
    MessageType,
    NodeId,
    PacketHeader,
    PowerCause,
    ReplayError,
    ReplayGuard,
    ResponseCode,
    SequenceCounter,
    TaskPhase,
    WireError,
    decode,
    encode,
)
from common.wire import messages as m
from common.wire.ids import EventId
from common.wire.link import (
    KeyLayout,
    LinkError,
    bound_endpoint,
    recv_packet,
    send_packet,
    server_socket,
    start_authenticator,
)

RESULT_TEXT = "two ships in the harbour; the bridge is intact"


class ScriptedBusPayloadPeer:
    def __init__(self, layout: KeyLayout, *, route_replies: bool = True):
        self.layout = layout
        self.route_replies = route_replies
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, layout)
        self.router = server_socket(self.ctx, zmq.ROUTER, layout, "tcp://127.0.0.1:*")
        self.pub = server_socket(self.ctx, zmq.PUB, layout, "tcp://127.0.0.1:*")
        self.commands_endpoint = bound_endpoint(self.router)
        self.telemetry_endpoint = bound_endpoint(self.pub)
        self.lock = threading.RLock()
        self.guard = ReplayGuard()
        self.tm_counter = SequenceCounter()
        # --- payload state (survives power cuts, as the flight software's disk does) ---
        self.images: dict[str, dict] = {}
        self.tasks: dict[str, dict] = {}
        self.boot_count = 1
        self.booted_at = time.monotonic()
        #: PAYLOAD_PROFILE / WINDOW_HISTORY sent before the HOUSEKEEPING that answers STATUS (none: a
        #: payload that has not sent them)
        self.forecast_packets: list[m.Message] = []
        # --- what happened, for assertions ---
        self.commands: list[tuple[str | None, PacketHeader, m.Message]] = []
        self.replays: list = []
        self.chunk_receipts: Counter = Counter()
        self.stored_before_cut: set[tuple[str, int]] = set()
        self.dropped_at_cut = 0
        self.cuts = 0
        self.bus_restarts = 0
        # --- script ---
        self.powered = True
        self.store_while_off = True
        self.off_until: float | None = None
        self.backlog: list = []
        self.cut_after_chunks: int | None = None
        self.restart_bus_on_chunk: int | None = None
        self.chunk_packets_seen = 0
        self.cut_before: MessageType | None = None
        self.off_s = 1.5
        #: while off, come back only once this many commands of this type have arrived since the
        #: cut (besides `off_s`): the ground's re-query or resend, sent when its timeout ran out.
        #: So a test of "the ground notices and asks again" waits for the ground to have asked,
        #: not for its timeout to run out within the off span on a loaded machine.
        self.wake_after: tuple[MessageType, int] | None = None
        self.asked_while_off = 0
        self.reject_next: dict[MessageType, tuple[ResponseCode, str]] = {}
        self.bus_rejects_next: dict[MessageType, tuple[ResponseCode, str]] = {}
        self.task_run_s: float | None = None  # None: accepted tasks never run
        self.result_text = RESULT_TEXT  # the text of every result
        self.quarantined = m.QuarantineList(items=[], exits=[], reasons=[], total=0)  # LIST_QUARANTINE's answer
        self.stored_chunks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="test-peer", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> ScriptedBusPayloadPeer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.close(linger=0)
        self.pub.close(linger=0)
        self.auth.stop()
        self.ctx.term()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def commands_of(self, message_type: MessageType) -> list[m.Message]:
        with self.lock:
            return [msg for _, _, msg in self.commands if msg.TYPE == message_type]

    def sequence_numbers(self) -> list[int]:
        with self.lock:
            return [header.seq for _, header, _ in self.commands]

    # --- telemetry ----------------------------------------------------------------------------
    def _tm(self, message: m.Message, apid: int = Apid.PAYLOAD, source: int = NodeId.PAYLOAD) -> bytes:
        return encode(message, apid, self.tm_counter.next(apid), source_id=source)

    def publish(self, message: m.Message, *, bus: bool = False) -> None:
        with self.lock:
            packet = self._tm(message, Apid.BUS if bus else Apid.PAYLOAD, NodeId.BUS if bus else NodeId.PAYLOAD)
            self.pub.send(packet)

    def _reply(self, message: m.Message, routing_id: bytes | None, *, from_bus: bool = False) -> None:
        packet = self._tm(message, Apid.BUS, NodeId.BUS) if from_bus else self._tm(message)
        if self.route_replies and routing_id is not None:
            try:
                send_packet(self.router, packet, routing_id=routing_id, timeout_s=1)
            except LinkError:
                pass  # the sender is gone; the PUB copy still goes out
        self.pub.send(packet)

    # --- main loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self._tick()
                router = self.router
            received = recv_packet(router, timeout_s=0.02)
            if received is None:
                continue
            with self.lock:
                if not self.powered:
                    if self.store_while_off:
                        self.backlog.append(received)
                    self._note_while_off(received)
                    continue
                self._handle(received)

    def _note_while_off(self, received) -> None:
        if self.wake_after is None:
            return
        try:
            _, message = decode(received.packet)
        except WireError:
            return
        if message.TYPE == self.wake_after[0]:
            self.asked_while_off += 1

    def _awake(self, now: float) -> bool:
        if self.off_until is None or now < self.off_until:
            return False
        return self.wake_after is None or self.asked_while_off >= self.wake_after[1]

    def _tick(self) -> None:
        now = time.monotonic()
        if not self.powered and self._awake(now):
            self.powered = True
            self.boot_count += 1
            self.booted_at = now
            self.publish(m.PowerStateChange(trace_time_s=1.0, payload_on=True, cause=PowerCause.RESTORED), bus=True)
            self.publish(m.Event(event_id=EventId.BOOT, text=f"boot {self.boot_count}"))
            backlog, self.backlog = self.backlog, []
            for received in backlog:
                self._handle(received)
        if self.powered:
            for task in self.tasks.values():
                if task["state"] == "queued" and task.get("finish_at") is not None and now >= task["finish_at"]:
                    self._finish_task(task)

    def power_cut(self) -> None:
        """Payload power off for `off_s`: what it had received but not handled is gone."""
        self.cuts += 1
        self.powered = False
        self.asked_while_off = 0
        self.off_until = time.monotonic() + self.off_s
        self.stored_before_cut = {(name, i) for name, img in self.images.items() for i in img["chunks"]}
        self.publish(m.PowerStateChange(trace_time_s=1.0, payload_on=False, cause=PowerCause.ECLIPSE), bus=True)
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline:
            if recv_packet(self.router, timeout_s=0.01) is not None:
                self.dropped_at_cut += 1

    def restart_bus(self) -> None:
        """Close and rebind the bus sockets: queued packets and routing ids are lost."""
        self.bus_restarts += 1
        self.stored_before_cut = {(name, i) for name, img in self.images.items() for i in img["chunks"]}
        self.router.close(linger=0)
        self.pub.close(linger=0)
        time.sleep(0.3)
        self.router = server_socket(self.ctx, zmq.ROUTER, self.layout, self.commands_endpoint)
        self.pub = server_socket(self.ctx, zmq.PUB, self.layout, self.telemetry_endpoint)

    # --- the payload's command handling -------------------------------------------------------
    def _handle(self, received) -> None:
        try:
            header, msg = decode(received.packet)
        except WireError as err:
            self._reply(m.Rejected.from_error(err), received.routing_id)
            return
        if not msg.is_command():
            return
        if msg.TYPE == MessageType.IMAGE_CHUNK and self.restart_bus_on_chunk is not None:
            self.chunk_packets_seen += 1
            if self.chunk_packets_seen == self.restart_bus_on_chunk:
                # The bus dies holding this chunk (and whatever else it had queued).
                self.restart_bus_on_chunk = None
                self.restart_bus()
                return
        if self.cut_before is not None and msg.TYPE == self.cut_before:
            # The power goes before the payload takes this command; the bus still holds it.
            self.cut_before = None
            self.power_cut()
            self.backlog.append(received)
            return
        request = header.request
        try:
            self.guard.accept(request.apid, request.source_id, request.seq)
        except ReplayError as err:
            self.replays.append(request)
            self._reply(m.Rejected.from_error(err, request), received.routing_id)
            return
        rid = received.routing_id
        task_id = getattr(msg, "task_id", None)
        if msg.TYPE in self.bus_rejects_next:
            # The bus refuses to relay it and answers for itself (APID BUS, source BUS).
            code, reason = self.bus_rejects_next.pop(msg.TYPE)
            self._reply(m.Rejected.about(request, code=code, reason=reason, task_id=task_id), rid, from_bus=True)
            return
        self.commands.append((received.user_id, header, msg))
        if msg.TYPE in self.reject_next:
            code, reason = self.reject_next.pop(msg.TYPE)
            self._reply(m.Rejected.about(request, code=code, reason=reason, task_id=task_id), rid)
            return
        try:
            handler = getattr(self, f"_on_{msg.TYPE.name.lower()}")
            handler(request, msg, rid)
        except WireError as err:
            self._reply(m.Rejected.from_error(err, request, task_id), rid)

    def _on_ping(self, request, msg: m.Ping, rid) -> None:
        self._reply(m.Accepted.about(request), rid)
        self._reply(m.Pong(key=msg.key), rid)
        self._reply(m.Completed.about(request), rid)

    def housekeeping(self) -> m.Housekeeping:
        queued = [t for t in self.tasks.values() if t["state"] == "queued"]
        return m.Housekeeping(
            queue_depth=len(queued),
            current_task=queued[0]["message"].task_id if queued else None,
            phase=TaskPhase.PREFILL if queued else None,
            progress_done=1 if queued else 0,
            progress_total=4 if queued else 0,
            checkpoint_bytes=123456,
            disk_free_bytes=9 * 1024**3,
            boot_count=self.boot_count,
            command_count=len(self.commands),
            error_count=len(self.replays),
            uptime_s=time.monotonic() - self.booted_at,
            memory_rss_bytes=300 * 1024**2,
            written_bytes=5 * 1024**2,
        )

    def _on_status(self, request, msg, rid) -> None:
        self._reply(m.Accepted.about(request), rid)
        for packet in self.forecast_packets:  # as a payload sends them at power-on, before HOUSEKEEPING
            self._reply(packet, rid)
        self._reply(self.housekeeping(), rid)
        self._reply(m.Completed.about(request), rid)

    def _image_status(self, name: str) -> m.ImageStatus:
        image = self.images.get(name)
        if image is None:
            return m.ImageStatus.of(name, 0, 0, [])
        if image["verified"]:
            return m.ImageStatus.of(name, image["size"], image["total"], range(image["total"]), verified=True)
        return m.ImageStatus.of(name, image["size"], image["total"], image["chunks"].keys())

    def _on_image_query(self, request, msg: m.ImageQuery, rid) -> None:
        self._reply(m.Accepted.about(request), rid)
        self._reply(self._image_status(msg.image), rid)
        self._reply(m.Completed.about(request), rid)

    def _on_image_chunk(self, request, msg: m.ImageChunk, rid) -> None:
        self.chunk_receipts[(msg.image, msg.index)] += 1
        image = self.images.setdefault(
            msg.image,
            {"size": msg.image_size, "total": msg.total, "sha256": msg.sha256, "chunks": {}, "verified": False},
        )
        if (image["size"], image["total"], image["sha256"]) != (msg.image_size, msg.total, msg.sha256):
            raise WireError(
                ResponseCode.CHUNK_CONFLICT, f"image {msg.image}: size/count/hash differ from earlier chunks"
            )
        if not image["verified"] and msg.index not in image["chunks"]:
            image["chunks"][msg.index] = msg.data
            self.stored_chunks += 1
            if len(image["chunks"]) == image["total"]:
                content = b"".join(image["chunks"][i] for i in range(image["total"]))
                if hashlib.sha256(content).digest() != image["sha256"]:
                    del self.images[msg.image]
                    raise WireError(ResponseCode.FILE_HASH_MISMATCH, f"{msg.image}: assembled file does not match")
                from PIL import Image

                Image.open(io.BytesIO(content)).load()
                image["verified"] = True
                image["content"] = content
        self._reply(m.Accepted.about(request), rid)
        if self.cut_after_chunks is not None and self.stored_chunks == self.cut_after_chunks:
            self.cut_after_chunks = None
            self.power_cut()

    def _on_uplink_task(self, request, msg: m.UplinkTask, rid) -> None:
        existing = self.tasks.get(msg.task_id)
        content = (msg.prompt, msg.images, msg.max_new_tokens)
        if existing is not None:
            if existing["content"] != content:
                raise WireError(ResponseCode.DUPLICATE_TASK, f"task {msg.task_id} exists with other content")
            self._reply(m.Accepted.about(request, task_id=msg.task_id), rid)
            return
        self.tasks[msg.task_id] = {
            "message": msg,
            "content": content,
            "request": request,
            "state": "queued",
            "priority": msg.priority,
            "finish_at": None if self.task_run_s is None else time.monotonic() + self.task_run_s,
            "result": None,
        }
        self._reply(m.Accepted.about(request, task_id=msg.task_id), rid)

    def _finish_task(self, task: dict) -> None:
        request, task_id = task["request"], task["message"].task_id
        self.publish(m.Started.about(request, task_id=task_id))
        self.publish(m.Progress.about(request, task_id=task_id, phase=TaskPhase.PREFILL, done=4, total=4))
        task["state"] = "completed"
        task["result"] = m.TaskResult(
            task_id=task_id,
            token_ids=(5, 6, 7),
            text=self.result_text,
            logits_sha256=bytes(32),
            timings={"prefill": 0.25, "total": 0.5},
            interruptions=1,
            recovery_s=[0.125],
            recovery_phases=["prefill"],
            recovery_planners=["optimal"],
            written_bytes=3 * 1024 * 1024,
        )
        self.publish(m.Completed.about(request, task_id=task_id))

    def _on_downlink_result(self, request, msg: m.DownlinkResult, rid) -> None:
        task = self.tasks.get(msg.task_id)
        if task is None:
            raise WireError(ResponseCode.UNKNOWN_TASK, f"no task {msg.task_id}")
        if task["state"] != "completed":
            raise WireError(ResponseCode.RESULT_NOT_READY, f"task {msg.task_id} is {task['state']}")
        self._reply(m.Accepted.about(request, task_id=msg.task_id), rid)
        self._reply(task["result"], rid)
        self._reply(m.Completed.about(request, task_id=msg.task_id), rid)

    def _on_cancel_task(self, request, msg: m.CancelTask, rid) -> None:
        task = self.tasks.get(msg.task_id)
        if task is None:
            raise WireError(ResponseCode.UNKNOWN_TASK, f"no task {msg.task_id}")
        if task["state"] != "queued":
            raise WireError(ResponseCode.TASK_FINISHED, f"task {msg.task_id} is {task['state']}")
        self._reply(m.Accepted.about(request, task_id=msg.task_id), rid)
        task["state"] = "cancelled"
        self.publish(
            m.Failed.about(
                task["request"], task_id=msg.task_id, code=ResponseCode.CANCELLED, reason="cancelled by command"
            )
        )
        self._reply(m.Completed.about(request, task_id=msg.task_id), rid)

    def _on_set_priority(self, request, msg: m.SetPriority, rid) -> None:
        task = self.tasks.get(msg.task_id)
        if task is None:
            raise WireError(ResponseCode.UNKNOWN_TASK, f"no task {msg.task_id}")
        task["priority"] = msg.priority
        self._reply(m.Accepted.about(request, task_id=msg.task_id), rid)
        self._reply(m.Completed.about(request, task_id=msg.task_id), rid)

    def _on_list_quarantine(self, request, msg: m.ListQuarantine, rid) -> None:
        self._reply(m.Accepted.about(request), rid)
        self._reply(self.quarantined, rid)
        self._reply(m.Completed.about(request), rid)

    # --- scripted telemetry, called from the test thread ----------------------------------------
    def fail_task(self, task_id: str, code: ResponseCode, reason: str) -> None:
        """The task fails on board. The report names it only by its UPLINK_TASK's request id
        (task_id left out), so the ground must correlate by request id."""
        with self.lock:
            task = self.tasks[task_id]
            task["state"] = "failed"
            self.publish(m.Failed.about(task["request"], code=code, reason=reason))

    def start_publishing(self, messages: list[tuple[m.Message, bool]], every_s: float = 0.1) -> threading.Event:
        """Publish `messages` ((message, is_bus) pairs) every `every_s` until the returned event is set."""
        stop = threading.Event()

        def run():
            while not stop.is_set() and not self._stop.is_set():
                for message, bus in messages:
                    self.publish(message, bus=bus)
                stop.wait(every_s)

        threading.Thread(target=run, name="test-peer-publisher", daemon=True).start()
        return stop
