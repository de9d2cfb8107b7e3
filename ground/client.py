"""`GroundClient`: every ground operation, callable in-process (the CLI is a thin layer on it).

    with GroundClient("keys", endpoints=Endpoints(commands=..., telemetry=...)) as ground:
        rtt = ground.ping()
        hk = ground.status()
        up = ground.uplink(["a.png"], "describe the coast", max_new_tokens=32)
        result = ground.result(up.task_id, wait=True)

Answers are correlated by request id (APID, source id, sequence number, type) and task id, from
the commands link and the telemetry link alike (ground.link). Nothing here assumes an answer
comes back: every wait has a timeout, and an uplink that stops hearing back re-asks the payload
what it holds (IMAGE_QUERY) and sends only what is missing, so it resumes after link loss, a bus
restart or a payload power cut without sending a held chunk again or queueing a task twice.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import zmq

from common import log
from common.wire import Apid, MessageType, NodeId, RequestRef, ResponseCode
from common.wire import messages as m
from common.wire.ids import DEFAULT_CHUNK_DATA_BYTES, MAX_CHUNK_DATA_BYTES
from common.wire.link import Endpoints, KeyLayout
from ground.errors import CommandRejected, GroundError, LocalInputError, NoAnswer
from ground.images import (
    PreparedImage,
    check_chunk_bytes,
    check_max_new_tokens,
    check_operator_name,
    check_priority,
    check_prompt,
    new_task_id,
    prepare_images,
)
from ground.link import GroundLink, Telemetry
from ground.state import GroundState

_log = log.get("ground.client")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 12
DEFAULT_WINDOW = 8
DEFAULT_MAX_NEW_TOKENS = 64
#: Reports remembered per client (a long campaign must not grow memory without bound).
REPORT_MEMORY = 65536
_FINAL_TASK_STATES = ("completed", "failed", "cancelled")
#: Rejections that mean "our sequence counter is off", fixed by resynchronising and resending.
_RESYNC_CODES = (ResponseCode.REPLAYED_SEQUENCE, ResponseCode.SEQUENCE_TOO_FAR_AHEAD)


def request_dict(ref: RequestRef) -> dict:
    return {"apid": ref.apid, "source_id": ref.source_id, "seq": ref.seq, "message_type": ref.message_type}


def request_from_dict(d: dict) -> RequestRef:
    return RequestRef(apid=d["apid"], source_id=d["source_id"], seq=d["seq"], message_type=d["message_type"])


@dataclass
class ImageUpload:
    """What happened to one image during an uplink."""

    path: str
    name: str
    size: int
    sha256: str
    chunks: int
    #: chunks the payload already held when the uplink started (not sent)
    held_before: int = 0
    #: IMAGE_CHUNK packets sent (a chunk lost with the link is sent again and counted again)
    chunks_sent: int = 0
    queries: int = 0
    #: rounds that stopped hearing back and resumed with IMAGE_QUERY
    resumes: int = 0
    verified: bool = False


@dataclass
class UplinkResult:
    task_id: str
    #: request id of the UPLINK_TASK the payload accepted
    request: dict
    #: the task id came from an earlier identical uplink (nothing new was queued)
    reused_task_id: bool
    images: list[ImageUpload] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class GroundClient:
    """One ground station's session with the bus and, through it, the payload.

    keys_dir      keys directory (clients/<station>.key_secret, server/bus.key, state/)
    station       client key name; source_id: the secondary-header source id (own replay window)
    timeout_s     how long to wait for an answer before calling it "no answer"
    retries       unanswered rounds an uplink tolerates (re-asking each time) before giving up
    window        IMAGE_CHUNKs in flight at once
    notify        where operator notices go (default: structlog warnings)
    progress      tqdm bar on stderr during uploads: True, False, or None (only on a terminal)
    """

    def __init__(
        self,
        keys_dir: str | os.PathLike,
        *,
        station: str = "ground",
        source_id: int = NodeId.GROUND,
        endpoints: Endpoints | None = None,
        state_dir: str | os.PathLike | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        window: int = DEFAULT_WINDOW,
        chunk_bytes: int = DEFAULT_CHUNK_DATA_BYTES,
        notify: Callable[[str], None] | None = None,
        progress: bool | None = False,
        context: zmq.Context | None = None,
        commands: bool = True,
    ):
        if not 1 <= int(source_id) <= 0xFF:
            raise LocalInputError(f"source id {source_id} outside 1..255 (ground stations)")
        if timeout_s <= 0 or retries < 0 or window < 1:
            raise LocalInputError("timeout must be > 0, retries >= 0, window >= 1")
        self.layout = KeyLayout(Path(keys_dir))
        self.station = check_operator_name(station, "station name")
        self.source_id = int(source_id)
        self.endpoints = endpoints or Endpoints.from_env()
        self.state = GroundState(state_dir if state_dir is not None else self.layout.state_dir)
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.window = int(window)
        self.chunk_bytes = check_chunk_bytes(chunk_bytes)
        self.progress = progress
        self._notify_fn = notify
        self.link = GroundLink(
            self.layout.root,
            station=self.station,
            endpoints=self.endpoints,
            handshake_timeout_s=self.timeout_s,
            commands=commands,
            context=context,
        )
        # --- what has arrived (filled by _note) ---
        self._arrivals = 0
        self._reports: OrderedDict[RequestRef, list[tuple[int, m.Verification]]] = OrderedDict()
        self._image_status: dict[str, tuple[int, m.ImageStatus]] = {}
        self._pongs: dict[int, tuple[int, float]] = {}
        self._housekeeping: tuple[int, m.Housekeeping] | None = None
        self._results: dict[str, tuple[int, m.TaskResult]] = {}
        self._quarantine: tuple[int, m.QuarantineList] | None = None
        self._lost: tuple[int, m.LostTasks] | None = None
        self._task_final: dict[str, tuple[int, m.Verification]] = {}
        self._task_requests: dict[RequestRef, str] = {}
        self._refused_by_bus: set[RequestRef] = set()
        self._watched: dict[str, tuple] = {}
        self.payload_on: bool | None = None
        self.power_cause: str | None = None
        self.observers: list[Callable[[Telemetry], None]] = []

    # --- lifecycle ----------------------------------------------------------------------------
    def open(self) -> GroundClient:
        """Connect to the bus (CURVE handshake on both links); idempotent. Raises LinkRefused
        (key not authorized), NoAnswer (no bus) or LocalInputError (keys missing)."""
        self.link.open()
        return self

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> GroundClient:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def _notify(self, text: str) -> None:
        if self._notify_fn is not None:
            self._notify_fn(text)
        else:
            _log.warning("ground_notice", text=text)

    # --- receiving ----------------------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        for packet in self.link.receive(timeout_s):
            self._note(packet)

    def _note(self, packet: Telemetry) -> None:
        self._arrivals += 1
        n = self._arrivals
        msg = packet.message
        if isinstance(msg, m.Verification):
            if msg.tc_source == self.source_id and msg.tc_apid == Apid.PAYLOAD:
                self._reports.setdefault(msg.request, []).append((n, msg))
                if isinstance(msg, m.Rejected) and packet.header.apid == Apid.BUS:
                    self._refused_by_bus.add(msg.request)
                if len(self._reports) > REPORT_MEMORY:
                    self._reports.popitem(last=False)
            if msg.tc_type == MessageType.UPLINK_TASK:
                task_id = msg.task_id or self._task_requests.get(msg.request)
                if task_id is not None:
                    self._note_task_report(n, task_id, msg)
        elif isinstance(msg, m.ImageStatus):
            self._image_status[msg.image] = (n, msg)
        elif isinstance(msg, m.Pong):
            self._pongs[msg.key] = (n, packet.received_at)
        elif isinstance(msg, m.Housekeeping):
            self._housekeeping = (n, msg)
        elif isinstance(msg, m.TaskResult):
            self._results[msg.task_id] = (n, msg)
        elif isinstance(msg, m.QuarantineList):
            self._quarantine = (n, msg)
        elif isinstance(msg, m.LostTasks):
            self._lost = (n, msg)
        elif isinstance(msg, (m.PowerReport, m.PowerStateChange)):
            self.payload_on = msg.payload_on
            if isinstance(msg, m.PowerStateChange):
                self.power_cause = str(msg.cause)
        for observer in self.observers:
            observer(packet)

    def _note_task_report(self, n: int, task_id: str, msg: m.Verification) -> None:
        """Reports about a task's execution: they refer to its UPLINK_TASK's request id."""
        if isinstance(msg, (m.Completed, m.Failed)):
            self._task_final[task_id] = (n, msg)
            if self.state.task(task_id) is not None:  # one of ours: keep the task list current
                if isinstance(msg, m.Completed):
                    self.state.update_task(task_id, state="completed")
                else:
                    state = "cancelled" if msg.code == ResponseCode.CANCELLED else "failed"
                    self.state.update_task(task_id, state=state, code=msg.code.name, reason=msg.reason)
        if task_id in self._watched:
            if isinstance(msg, m.Started):
                key = ("started",)
                text = f"task {task_id}: started"
            elif isinstance(msg, m.Progress):
                key = (str(msg.phase), msg.done == msg.total)
                text = f"task {task_id}: {msg.phase} {msg.done}/{msg.total}"
            else:
                return
            if self._watched[task_id] != key:
                self._watched[task_id] = key
                self._notify(text)

    def _wait(self, condition: Callable[[], Any], timeout_s: float) -> Any:
        """Pump packets until `condition()` is not None (returned) or `timeout_s` passes (None)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._pump(min(remaining, 0.5))

    # --- sending ------------------------------------------------------------------------------
    def _send(self, message: m.Message) -> RequestRef:
        seq = self.state.counter.next(Apid.PAYLOAD)
        self.link.send(message, seq, source_id=self.source_id, timeout_s=self.timeout_s)
        _log.debug("ground_sent", type=message.TYPE.name, seq=seq)
        return RequestRef(apid=int(Apid.PAYLOAD), source_id=self.source_id, seq=seq, message_type=int(message.TYPE))

    def _resync(self, report: m.Rejected) -> None:
        """REPLAYED_SEQUENCE: our counter is behind what the payload has seen from this source
        (lost state, or another ground process using the same source id). Move past it (§6.4).
        SEQUENCE_TOO_FAR_AHEAD: it ran beyond the payload's forward window; continue just after
        the payload's highest accepted number instead."""
        if report.code == ResponseCode.SEQUENCE_TOO_FAR_AHEAD:
            self.state.counter.rebase(Apid.PAYLOAD, report.highest_seq)
            self._notify(
                f"payload reports sequence {report.tc_seq} as too far ahead of its highest accepted "
                f"{report.highest_seq}; sequence counter rebased, sending again"
            )
            return
        self.state.counter.advance_past(Apid.PAYLOAD, report.highest_seq)
        self._notify(
            f"payload reports sequence {report.tc_seq} as already used (highest accepted {report.highest_seq}); "
            "sequence counter moved past it, sending again"
        )

    def _rejection(self, what: str, report: m.Verification) -> CommandRejected:
        by = "bus" if report.request in self._refused_by_bus else "payload"
        return CommandRejected(what, report.code, report.reason, failed=isinstance(report, m.Failed), by=by)

    def _silence(self, what: str, waited_s: float) -> str:
        if self.payload_on is False:
            cause = f" ({self.power_cause})" if self.power_cause else ""
            return f"{what}: no answer within {waited_s:g} s: the bus reports the payload powered off{cause}; commands are queued at the bus"
        return f"{what}: no answer within {waited_s:g} s: payload not answering; commands are queued at the bus"

    def _verdict(self, refs: list[RequestRef], want: type) -> m.Verification | None:
        """A Rejected/Failed about any of `refs`, else a report of class `want`, else None."""
        found = None
        for ref in refs:
            for _, report in self._reports.get(ref, ()):
                if isinstance(report, (m.Rejected, m.Failed)):
                    return report
                if found is None and isinstance(report, want):
                    found = report
        return found

    def _transact(
        self,
        message: m.Message,
        what: str,
        *,
        reply: Callable[[int], Any] | None = None,
        completion: bool = False,
        retries: int = 0,
        on_send: Callable[[RequestRef], None] | None = None,
    ) -> tuple[RequestRef, Any]:
        """Send `message` and wait for its outcome: `reply(mark)` not None (a reply packet that
        arrived after `mark`), else COMPLETED (`completion`) or ACCEPTED. REJECTED/FAILED raise
        CommandRejected, except REPLAYED_SEQUENCE, which resynchronises and sends again. With
        `retries`, an unanswered command is sent again (only for idempotent commands); reports
        about any of the copies count."""
        refs: list[RequestRef] = []
        mark = self._arrivals
        stalls = resyncs = 0
        want = m.Completed if completion else m.Accepted
        while True:
            ref = self._send(message)
            refs.append(ref)
            if on_send is not None:
                on_send(ref)

            def outcome():
                verdict = self._verdict(refs, want)
                if isinstance(verdict, (m.Rejected, m.Failed)):
                    return verdict
                if reply is not None:
                    value = reply(mark)
                    return None if value is None else (refs[-1], value)
                return None if verdict is None else (verdict.request, verdict)

            result = self._wait(outcome, self.timeout_s)
            if result is None:
                stalls += 1
                if stalls > retries:
                    raise NoAnswer(self._silence(what, self.timeout_s))
                self._notify(f"{self._silence(what, self.timeout_s)}; sending again ({stalls}/{retries})")
                continue
            if isinstance(result, m.Rejected):
                if result.code in _RESYNC_CODES and result.highest_seq is not None and resyncs < 3:
                    resyncs += 1
                    refs.remove(result.request)
                    self._resync(result)
                    continue
                raise self._rejection(what, result)
            if isinstance(result, m.Failed):
                raise CommandRejected(what, result.code, result.reason, failed=True)
            return result

    # --- simple commands ----------------------------------------------------------------------
    def ping(self) -> float:
        """PING -> PONG; the round-trip time in seconds."""
        key = random.getrandbits(32)
        started = time.time()
        self._transact(m.Ping(key=key), "PING", reply=lambda mark: self._after(self._pongs.get(key), mark))
        return self._pongs[key][1] - started

    def status(self) -> m.Housekeeping:
        """STATUS -> the next HOUSEKEEPING report (any report after the request is current)."""
        _, hk = self._transact(m.Status(), "STATUS", reply=lambda mark: self._after(self._housekeeping, mark))
        return hk

    @staticmethod
    def _after(entry: tuple | None, mark: int) -> Any:
        return entry[1] if entry is not None and entry[0] > mark else None

    def cancel(self, task_id: str) -> None:
        """CANCEL_TASK -> ACCEPTED + COMPLETED (the task itself then ends FAILED(CANCELLED))."""
        task_id = check_operator_name(task_id, "task id")
        self._transact(m.CancelTask(task_id=task_id), f"CANCEL_TASK {task_id}", completion=True)
        if self.state.task(task_id) is not None:
            self.state.update_task(task_id, cancel_requested=True)

    def set_priority(self, task_id: str, priority: int) -> None:
        task_id = check_operator_name(task_id, "task id")
        priority = check_priority(priority)
        self._transact(m.SetPriority(task_id=task_id, priority=priority), f"SET_PRIORITY {task_id}", completion=True)
        if self.state.task(task_id) is not None:
            self.state.update_task(task_id, priority=priority)

    # --- health and safety ---------------------------------------------------------------------
    def quarantine(self) -> m.QuarantineList:
        """LIST_QUARANTINE -> the items the payload holds back after repeated abnormal exits."""
        _, listing = self._transact(
            m.ListQuarantine(), "LIST_QUARANTINE", reply=lambda mark: self._after(self._quarantine, mark)
        )
        return listing

    def release(self, item: str) -> None:
        """RELEASE_QUARANTINE: the payload handles `item` again (a task is queued again)."""
        self._transact(m.ReleaseQuarantine(item=item), f"RELEASE_QUARANTINE {item}", completion=True)

    def lost_tasks(self) -> m.LostTasks:
        """LIST_LOST_TASKS -> the tasks the payload lost to storage damage."""
        _, lost = self._transact(m.ListLostTasks(), "LIST_LOST_TASKS", reply=lambda mark: self._after(self._lost, mark))
        return lost

    def resend(self, task_id: str) -> UplinkResult:
        """Upload a known task's images again where the payload lacks them (one found damaged on
        board, IMAGE_CORRUPT) and send its UPLINK_TASK again (idempotent on the payload)."""
        task_id = check_operator_name(task_id, "task id")
        known = self.state.task(task_id)
        if known is None or not known.get("image_files"):
            raise LocalInputError(f"task {task_id} was not uplinked from this station (no image files recorded)")
        return self.uplink(
            known["image_files"],
            known["prompt"],
            max_new_tokens=known["max_new_tokens"],
            priority=known.get("priority", 0),
            task_id=task_id,
        )

    # --- images -------------------------------------------------------------------------------
    def query_image(self, name: str) -> m.ImageStatus:
        _, status = self._transact(
            m.ImageQuery(image=name),
            f"IMAGE_QUERY {name}",
            reply=lambda mark: self._after(self._image_status.get(name), mark),
        )
        return status

    def upload_image(self, image: PreparedImage) -> ImageUpload:
        """Send the chunks of `image` the payload does not hold, until it reports the file
        verified. Resumes by re-querying whenever answers stop for `timeout_s`."""
        chunks = image.chunks(self.chunk_bytes)
        stats = ImageUpload(
            path=image.path, name=image.name, size=image.size, sha256=image.sha256.hex(), chunks=len(chunks)
        )
        bar = self._progress_bar(image)
        stalls = 0
        first_answer = True
        try:
            while True:
                try:
                    status = self.query_image(image.name)
                    stats.queries += 1
                except NoAnswer as exc:
                    stalls += 1
                    stats.resumes += 1
                    self._give_up_after(stalls, exc, image)
                    self._notify(f"{exc}; asking again ({stalls}/{self.retries})")
                    continue
                if status.verified:
                    if status.image_size != image.size:
                        raise CommandRejected(
                            f"image {image.name}",
                            ResponseCode.CHUNK_CONFLICT,
                            f"the payload holds a verified {status.image_size}-byte file under this name, ours has {image.size}",
                        )
                    if first_answer:
                        stats.held_before = len(chunks)
                    bar.update(image.size - bar.n)
                    stats.verified = True
                    return stats
                if status.total and status.total != len(chunks):
                    chunks = self._adopt_chunking(image, status, chunks)
                    stats.chunks = len(chunks)
                missing = status.missing() if status.total else list(range(len(chunks)))
                missing_set = set(missing)
                held = [c for c in chunks if c.index not in missing_set]
                if first_answer:
                    stats.held_before = len(held)
                    first_answer = False
                    if held:
                        self._notify(
                            f"image {image.name}: payload already holds {len(held)}/{len(chunks)} chunks; sending {len(missing)}"
                        )
                bar.n = sum(len(c.data) for c in held)
                bar.refresh()
                if not missing:
                    # Every chunk held but not verified yet: the payload is still checking the file.
                    stalls += 1
                    self._give_up_after(
                        stalls,
                        NoAnswer(f"image {image.name}: payload holds every chunk but does not report it verified"),
                        image,
                    )
                    self._pump(min(self.timeout_s, 1.0))
                    continue
                try:
                    acked, finished = self._send_chunks(image, chunks, missing, bar, stats)
                except NoAnswer:
                    acked, finished = 0, False  # the link would not take a chunk: same as no answer
                if finished:
                    stalls = 0
                    continue
                # Acknowledgements stopped: ask what the payload holds now and send only that.
                stalls = 0 if acked else stalls + 1
                stats.resumes += 1
                exc = NoAnswer(self._silence(f"image {image.name}", self.timeout_s))
                self._give_up_after(stalls, exc, image)
                count = f" ({stalls}/{self.retries} unanswered rounds)" if stalls else ""
                self._notify(f"{exc}; re-querying to resume{count}")
        finally:
            bar.close()

    def _give_up_after(self, stalls: int, exc: NoAnswer, image: PreparedImage) -> None:
        if stalls > self.retries:
            raise NoAnswer(
                f"{exc}; gave up after {stalls} unanswered rounds. Chunks already delivered stay on board: "
                "run the same uplink again to resume"
            ) from None

    def _adopt_chunking(
        self, image: PreparedImage, status: m.ImageStatus, chunks: list[m.ImageChunk]
    ) -> list[m.ImageChunk]:
        """The payload holds part of this image cut into another number of chunks (an earlier
        uplink with another --chunk-bytes). Cut ours the same way, so that the held chunks count
        and none conflicts: with the chunk size this station recorded for the image, else with
        the one power-of-two size (or the maximum) that gives that many chunks. If none fits,
        the payload would refuse our chunks: say so, with the fix."""

        def fits(size: int) -> bool:
            return 1 <= size <= MAX_CHUNK_DATA_BYTES and math.ceil(image.size / size) == status.total

        recorded = [t.get("chunk_bytes") for t in self.state.tasks() if image.name in t.get("images", [])]
        candidates = [c for c in recorded if isinstance(c, int) and fits(c)]
        if not candidates:
            candidates = [c for c in [1 << k for k in range(9, 16)] + [MAX_CHUNK_DATA_BYTES] if fits(c)]
        if status.image_size != image.size or not candidates:
            raise CommandRejected(
                f"image {image.name}",
                ResponseCode.CHUNK_CONFLICT,
                f"the payload holds part of this image cut into {status.total} chunks by an earlier upload with another "
                f"chunk size; run the uplink with the --chunk-bytes used then",
            )
        size = candidates[0]
        self._notify(
            f"image {image.name}: payload holds it in {status.total} chunks; using {size}-byte chunks to match"
        )
        return image.chunks(size)

    def _send_chunks(
        self, image: PreparedImage, chunks: list[m.ImageChunk], missing: list[int], bar, stats: ImageUpload
    ) -> tuple[int, bool]:
        """Send `missing` with at most `window` unacknowledged. Returns (acknowledged, finished):
        it stops early, unfinished, when no acknowledgement arrives for `timeout_s`."""
        queue = deque(missing)
        inflight: dict[RequestRef, m.ImageChunk] = {}
        acked = resyncs = 0
        last_progress = time.monotonic()
        while queue or inflight:
            while queue and len(inflight) < self.window:
                chunk = chunks[queue.popleft()]
                inflight[self._send(chunk)] = chunk
                stats.chunks_sent += 1
            self._pump(0.2)
            for ref, chunk in list(inflight.items()):
                verdict = self._verdict([ref], m.Accepted)
                if verdict is None:
                    continue
                del inflight[ref]
                last_progress = time.monotonic()
                if isinstance(verdict, m.Accepted):
                    acked += 1
                    bar.update(len(chunk.data))
                elif verdict.code in _RESYNC_CODES and verdict.highest_seq is not None and resyncs < 3:
                    resyncs += 1
                    self._resync(verdict)
                    queue.appendleft(chunk.index)
                else:
                    raise self._rejection(f"image {image.name} ({image.path}) chunk {chunk.index}", verdict)
            if inflight and time.monotonic() - last_progress > self.timeout_s:
                return acked, False
        return acked, True

    def _progress_bar(self, image: PreparedImage):
        from tqdm import tqdm

        return tqdm(
            total=image.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=image.name,
            file=sys.stderr,
            disable=None if self.progress is None else not self.progress,
            leave=True,
            dynamic_ncols=True,
        )

    # --- tasks --------------------------------------------------------------------------------
    def uplink(
        self,
        image_paths: list[str],
        prompt: str,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        priority: int = 0,
        task_id: str | None = None,
        new_task: bool = False,
    ) -> UplinkResult:
        """Check everything locally, upload each image (only missing chunks), then queue the
        task (UPLINK_TASK) and wait for ACCEPTED. Running it again with the same input reuses
        the task id, so nothing is sent twice and no second task is queued."""
        prompt = check_prompt(prompt)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        priority = check_priority(priority)
        if task_id is not None:
            task_id = check_operator_name(task_id, "task id")
        images = prepare_images(list(image_paths))
        check_chunk_bytes(self.chunk_bytes, max(i.size for i in images))
        content = {
            "prompt": prompt,
            "images": [i.name for i in images],
            "max_new_tokens": max_new_tokens,
            "priority": priority,
        }
        reused = False
        if task_id is None and not new_task:
            same = self.state.find_same_task(content)
            if same is not None:
                task_id, reused = same["task_id"], True
                self._notify(
                    f"same task as {task_id} (state {same.get('state')}); re-sending it is harmless. "
                    "For a second run of it pass --new-task"
                )
        if task_id is None:
            known = {t["task_id"] for t in self.state.tasks()}
            task_id = new_task_id()
            while task_id in known:
                task_id = new_task_id()
        else:
            earlier = self.state.task(task_id)
            if (
                earlier is not None
                and earlier.get("state") != "rejected"
                and any(earlier.get(k) != v for k, v in content.items())
            ):
                raise LocalInputError(
                    f"task id {task_id} was already uplinked with other content (see `ow ground results`); choose another id"
                )
        self.state.update_task(
            task_id,
            **content,
            image_files=[os.path.abspath(i.path) for i in images],
            station=self.station,
            chunk_bytes=self.chunk_bytes,
            state=self.state.task(task_id).get("state", "uploading") if reused else "uploading",
        )
        uploads = [self.upload_image(image) for image in images]
        request = self.queue_task(task_id, prompt, [i.name for i in images], max_new_tokens, priority)
        return UplinkResult(task_id=task_id, request=request_dict(request), reused_task_id=reused, images=uploads)

    def queue_task(
        self, task_id: str, prompt: str, images: list[str], max_new_tokens: int, priority: int
    ) -> RequestRef:
        """UPLINK_TASK, sent again while unanswered (idempotent on the payload); the request
        ids are kept with the task so that its later reports can be recognised."""
        message = m.UplinkTask(
            task_id=task_id, prompt=prompt, images=images, max_new_tokens=max_new_tokens, priority=priority
        )

        def remember(ref: RequestRef) -> None:
            self._task_requests[ref] = task_id
            self.state.update_task(task_id, add_request=request_dict(ref))

        try:
            ref, _ = self._transact(message, f"task {task_id}", retries=self.retries, on_send=remember)
        except CommandRejected as exc:
            self.state.update_task(task_id, state="rejected", code=exc.code.name, reason=exc.reason)
            raise
        except NoAnswer:
            self.state.update_task(task_id, state="unconfirmed")
            raise
        task = self.state.task(task_id) or {}
        if task.get("state") not in _FINAL_TASK_STATES:
            self.state.update_task(task_id, state="accepted", request=request_dict(ref))
        else:
            self.state.update_task(task_id, request=request_dict(ref))
        return ref

    def _track_task(self, task_id: str) -> None:
        task = self.state.task(task_id)
        for d in (task or {}).get("requests", []):
            try:
                self._task_requests[request_from_dict(d)] = task_id
            except (KeyError, TypeError):
                continue

    def result(
        self, task_id: str, *, wait: bool = False, max_wait_s: float | None = None, poll_s: float = 30.0
    ) -> m.TaskResult:
        """DOWNLINK_RESULT -> TASK_RESULT. With `wait`, a task not finished yet is waited for:
        its COMPLETED (then asked again), FAILED (CommandRejected, failed=True), or `poll_s`
        passing (asked again, in case the COMPLETED was missed). Saves the result locally."""
        task_id = check_operator_name(task_id, "task id")
        self._track_task(task_id)
        deadline = None if max_wait_s is None else time.monotonic() + max_wait_s
        self._watched.setdefault(task_id, ())
        said_silent = False
        completed_acted_on = -1  # arrival number of the last COMPLETED that made us ask again
        while True:
            known = self.state.task(task_id) or {}
            if wait and known.get("state") in ("failed", "cancelled"):
                code = ResponseCode.__members__.get(str(known.get("code")), ResponseCode.INTERNAL_ERROR)
                raise CommandRejected(f"task {task_id}", code, known.get("reason", ""), failed=True)
            try:
                _, result = self._transact(
                    m.DownlinkResult(task_id=task_id),
                    f"DOWNLINK_RESULT {task_id}",
                    reply=lambda mark: self._after(self._results.get(task_id), mark),
                )
                self._store_result(result)
                return result
            except CommandRejected as exc:
                if not wait or exc.code != ResponseCode.RESULT_NOT_READY:
                    raise
                # Any final report seen in this session counts, even one that came before we asked.
                seen = self._task_final.get(task_id)
                if seen is not None and isinstance(seen[1], m.Failed):
                    raise CommandRejected(f"task {task_id}", seen[1].code, seen[1].reason, failed=True) from None
                if seen is not None and seen[0] > completed_acted_on:
                    completed_acted_on = seen[0]  # completed meanwhile: ask again at once
                    continue
                mark = self._arrivals
                final = self._wait(
                    lambda: self._after(self._task_final.get(task_id), mark), self._until(deadline, poll_s)
                )
                if isinstance(final, m.Failed):
                    raise CommandRejected(f"task {task_id}", final.code, final.reason, failed=True) from None
            except NoAnswer as exc:
                if not wait:
                    raise
                if not said_silent:
                    self._notify(f"{exc}; still waiting")
                    said_silent = True
            if deadline is not None and time.monotonic() >= deadline:
                raise NoAnswer(f"task {task_id}: no result within {max_wait_s:g} s")

    @staticmethod
    def _until(deadline: float | None, poll_s: float) -> float:
        if deadline is None:
            return poll_s
        return max(0.0, min(poll_s, deadline - time.monotonic()))

    def _store_result(self, result: m.TaskResult) -> None:
        from ground.report import to_jsonable

        record = to_jsonable(result)
        record["downlinked"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.state.save_result(result.task_id, record)
        if self.state.task(result.task_id) is not None:
            self.state.update_task(result.task_id, state="completed", result_tokens=len(result.token_ids))

    def tasks(self) -> list[dict]:
        """Tasks this station uplinked (local state), oldest first."""
        return self.state.tasks()

    # --- telemetry ----------------------------------------------------------------------------
    def telemetry(self, duration_s: float | None = None) -> Iterator[Telemetry]:
        """Every packet received, as it arrives, for `duration_s` (None: until the caller stops)."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while True:
            remaining = 0.5 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            for packet in self.link.receive(min(remaining, 0.5)):
                self._note(packet)
                yield packet


__all__ = [
    "GroundClient",
    "GroundError",
    "ImageUpload",
    "UplinkResult",
]
