"""Command/reply matching: the session's link to the bus, every packet that arrives sorted by what it
answers, and `_transact`, which sends a telecommand and waits for its outcome.

Answers are correlated by request id (APID, source id, sequence number, type) and task id, from
the commands link and the telemetry link alike (ground.link). Nothing here assumes an answer
comes back: every wait has a timeout."""

from __future__ import annotations

import os
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from common import log
from common.wire import Apid, EventId, MessageType, NodeId, RequestRef, ResponseCode
from common.wire import messages as m
from common.wire.link import Endpoints, KeyLayout, station_source_id
from ground.client.options import GroundOptions
from ground.errors import CommandRejected, LocalInputError, NoAnswer
from ground.forecast import forecast_profile
from ground.link import GroundLink, Telemetry
from ground.state import GroundState

_log = log.get("ground.client")

DEFAULT_MAX_NEW_TOKENS = 64
#: Reports remembered per client (a long campaign must not grow memory without bound).
REPORT_MEMORY = 65536
#: Cuts whose announcement the completion forecast keeps (the payload keeps as many windows).
CUTS_KEPT = 256
#: Rejections that mean "our sequence counter is off", fixed by resynchronising and resending.
RESYNC_CODES = (ResponseCode.REPLAYED_SEQUENCE, ResponseCode.SEQUENCE_TOO_FAR_AHEAD)


#: the count in a TASK_RESUMED event's text (flight/runtime/worker.py writes "resumed after N cut(s)")
_RESUMED_AFTER = re.compile(r"resumed after (\d+) cut")


def request_dict(ref: RequestRef) -> dict:
    return {"apid": ref.apid, "source_id": ref.source_id, "seq": ref.seq, "message_type": ref.message_type}


def request_from_dict(d: dict) -> RequestRef:
    return RequestRef(apid=d["apid"], source_id=d["source_id"], seq=d["seq"], message_type=d["message_type"])


@dataclass
class Arrivals:
    """What has arrived on a session's links, each as (arrival number, message) where the number
    says whether it came after a command was sent (`after`). Written only by `CommandSession.note`,
    on the thread that pumps the links."""

    #: packets noted so far (the arrival number of the latest)
    count: int = 0
    #: verification reports about this station's commands, by request id (the latest REPORT_MEMORY)
    reports: OrderedDict[RequestRef, list[tuple[int, m.Verification]]] = field(default_factory=OrderedDict)
    image_status: dict[str, tuple[int, m.ImageStatus]] = field(default_factory=dict)
    #: PONGs by key: (arrival number, time received)
    pongs: dict[int, tuple[int, float]] = field(default_factory=dict)
    housekeeping: tuple[int, m.Housekeeping] | None = None
    results: dict[str, tuple[int, m.TaskResult]] = field(default_factory=dict)
    quarantine: tuple[int, m.QuarantineList] | None = None
    lost: tuple[int, m.LostTasks] | None = None
    #: a task's COMPLETED or FAILED
    task_final: dict[str, tuple[int, m.Verification]] = field(default_factory=dict)
    #: which task an UPLINK_TASK's request id queued (its later reports name the request)
    task_requests: dict[RequestRef, str] = field(default_factory=dict)
    #: requests the bus itself refused (not the payload)
    refused_by_bus: set[RequestRef] = field(default_factory=set)
    #: tasks whose progress is told to the operator, with what was told last
    watched: dict[str, tuple] = field(default_factory=dict)
    #: when something about a task last arrived (a report or an event naming it): a task still
    #: heard from is not asked about again while it runs (ResultStore.result)
    task_heard: dict[str, float] = field(default_factory=dict)


class CommandSession:
    """The link, what has arrived, and sending with outcome matching; the part every other part of
    the client holds (its settings: GroundOptions)."""

    def __init__(self, keys_dir: str | os.PathLike, options: GroundOptions | None = None):
        options = options if options is not None else GroundOptions()  # checked when it was made
        self.options = options
        self.layout = KeyLayout(Path(keys_dir))
        self.station = options.station
        source_id = options.source_id
        if source_id is None:
            # The source id the bus binds to this station's key (docs/ground.md "Stations");
            # a keys directory from before bindings speaks as the first ground station.
            try:
                source_id = station_source_id(self.layout, self.station)
            except ValueError as exc:
                raise LocalInputError(f"station binding: {exc}") from None
            if source_id is None:
                source_id = NodeId.GROUND
            if not 1 <= int(source_id) <= 0xFF:  # a binding file's, not the caller's: not checked yet
                raise LocalInputError(f"source id {source_id} outside 1..255 (ground stations)")
        self.source_id = int(source_id)
        self.endpoints = options.endpoints or Endpoints.from_env()
        self.state = GroundState(options.state_dir if options.state_dir is not None else self.layout.state_dir)
        #: how long a command waits for its answer; the one option that may change between commands
        self.timeout_s = float(options.timeout_s)
        self.retries = options.retries
        self.window = options.window
        self.chunk_bytes = options.chunk_bytes
        self.progress = options.progress
        self._notify_fn = options.notify
        #: who sends, in the shared command log: `ow ground uplink`, `ow ground console`, ...
        self.origin = options.origin or f"{Path(sys.argv[0]).name or 'python'} (in-process client)"
        self._log_failed = False
        #: called with (image name, bytes the payload holds, image size) as an upload advances
        self.upload_progress = options.upload_progress
        self.link = GroundLink(
            self.layout.root,
            station=self.station,
            endpoints=self.endpoints,
            handshake_timeout_s=float(options.handshake_timeout_s),
            commands=options.commands,
            context=options.context,
        )
        #: what has arrived, sorted by what it answers (filled by `note`)
        self.arrivals = Arrivals()
        self._forecast_progress: dict | None = None  # the last progress kept for the forecast
        self._warned_since_on = False  # a SHUTDOWN_WARNING heard since the payload's power-up
        self.payload_on: bool | None = None
        self.power_cause: str | None = None
        self.observers: list[Callable[[Telemetry], None]] = []

    # --- lifecycle ----------------------------------------------------------------------------
    def open(self) -> Self:
        """Connect to the bus (CURVE handshake on both links); idempotent. Raises LinkRefused
        (key not authorized), NoAnswer (no bus) or LocalInputError (keys missing)."""
        self.link.open()
        return self

    def close(self) -> None:
        self.link.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def notify(self, text: str) -> None:
        if self._notify_fn is not None:
            self._notify_fn(text)
        else:
            _log.warning("ground_notice", text=text)

    # --- receiving ----------------------------------------------------------------------------
    def pump(self, timeout_s: float) -> None:
        for packet in self.link.receive(timeout_s):
            self.note(packet)

    def note(self, packet: Telemetry) -> None:
        self.arrivals.count += 1
        n = self.arrivals.count
        msg = packet.message
        if isinstance(msg, (m.PayloadProfile, m.WindowHistory, m.Housekeeping, m.Progress)):
            self._note_forecast_basis(packet)
        elif isinstance(msg, (m.ShutdownWarning, m.PowerStateChange)):
            self._note_cut(msg)
        if isinstance(msg, m.Verification):
            if msg.tc_source == self.source_id and msg.tc_apid in (Apid.PAYLOAD, Apid.BUS):
                self.arrivals.reports.setdefault(msg.request, []).append((n, msg))
                if isinstance(msg, m.Rejected) and packet.header.apid == Apid.BUS:
                    self.arrivals.refused_by_bus.add(msg.request)
                if len(self.arrivals.reports) > REPORT_MEMORY:
                    self.arrivals.reports.popitem(last=False)
            if msg.tc_type == MessageType.UPLINK_TASK:
                task_id = msg.task_id or self.arrivals.task_requests.get(msg.request)
                if task_id is not None:
                    self._note_task_report(n, task_id, msg)
        elif isinstance(msg, m.Event):
            if msg.task_id is not None:
                self.arrivals.task_heard[msg.task_id] = time.monotonic()
                if msg.task_id in self.arrivals.watched:
                    self._note_task_event(msg.task_id, msg)
        elif isinstance(msg, m.ImageStatus):
            self.arrivals.image_status[msg.image] = (n, msg)
        elif isinstance(msg, m.Pong):
            self.arrivals.pongs[msg.key] = (n, packet.received_at)
        elif isinstance(msg, m.Housekeeping):
            self.arrivals.housekeeping = (n, msg)
        elif isinstance(msg, m.TaskResult):
            self.arrivals.results[msg.task_id] = (n, msg)
        elif isinstance(msg, m.QuarantineList):
            self.arrivals.quarantine = (n, msg)
        elif isinstance(msg, m.LostTasks):
            self.arrivals.lost = (n, msg)
        elif isinstance(msg, (m.PowerReport, m.PowerStateChange)):
            self.payload_on = msg.payload_on
            if isinstance(msg, m.PowerStateChange):
                self.power_cause = str(msg.cause)
        for observer in self.observers:
            observer(packet)

    def _note_cut(self, msg: m.ShutdownWarning | m.PowerStateChange) -> None:
        """Count, for the completion forecast, the cuts heard and how many the bus announced
        (a SHUTDOWN_WARNING since the power-up): the payload keeps the steps it finished before an
        announced cut (ground/forecast.py). The most recent CUTS_KEPT are kept."""
        if isinstance(msg, m.ShutdownWarning):
            self._warned_since_on = True
            return
        if msg.payload_on:
            self._warned_since_on = False
            return
        cuts = self.state.forecast_basis().get("cuts") or {}
        recent = [bool(x) for x in cuts.get("recent", [])] + [self._warned_since_on]
        recent = recent[-CUTS_KEPT:]
        self._warned_since_on = False
        self.state.note_forecast_basis(cuts={"recent": recent, "heard": len(recent), "warned": sum(recent)})

    def _note_forecast_basis(self, packet: Telemetry) -> None:
        """Keep the completion forecast's inputs (ground/forecast.py) in the ground state: the
        payload's profile and window history whole, the running task's progress at most once a
        second (PROGRESS comes at up to 10 Hz) and at each phase change."""
        msg = packet.message
        if isinstance(msg, m.PayloadProfile):
            self.state.note_forecast_basis(profile=forecast_profile(msg))
        elif isinstance(msg, m.WindowHistory):
            windows = {"boot_count": msg.boot_count, "starts": list(msg.starts), "lengths": list(msg.lengths)}
            self.state.note_forecast_basis(windows=windows)
        else:
            if isinstance(msg, m.Housekeeping):
                task, phase, done, total = msg.current_task, msg.phase, msg.progress_done, msg.progress_total
            else:
                assert isinstance(msg, m.Progress)
                task, phase, done, total = msg.task_id, msg.phase, msg.done, msg.total
            last = self._forecast_progress
            progress = {
                "task_id": task,
                "phase": str(phase) if phase is not None else None,
                "done": done,
                "total": total,
                "heard_at": time.time(),
                # live tasks on board (HOUSEKEEPING only; PROGRESS keeps the last one heard)
                "queue_depth": msg.queue_depth if isinstance(msg, m.Housekeeping) else (last or {}).get("queue_depth"),
            }
            if last is not None and (last["task_id"], last["phase"]) == (task, progress["phase"]):
                if progress["heard_at"] - last["heard_at"] < 1.0 and not isinstance(msg, m.Housekeeping):
                    return
            self._forecast_progress = progress
            self.state.note_forecast_basis(progress=progress)

    def _note_task_event(self, task_id: str, event: m.Event) -> None:
        """A watched task's start, or its resume after a power cut: the payload's TASK_STARTED /
        TASK_RESUMED event says which (its STARTED report is the same for both), and the
        resume's text how many cuts the task has had ("task t-x resumed after 2 cut(s)")."""
        if event.event_id == EventId.TASK_STARTED:
            text = f"task {task_id}: started"
        elif event.event_id == EventId.TASK_RESUMED:
            cuts = _RESUMED_AFTER.search(event.text)
            text = f"task {task_id}: resumed after cut {cuts.group(1)}" if cuts else f"task {task_id}: resumed"
        else:
            return
        self.arrivals.watched[task_id] = ("run", event.event_id, event.text)  # the phases print again after it
        self.notify(text)

    def _note_task_report(self, n: int, task_id: str, msg: m.Verification) -> None:
        """Reports about a task's execution: they refer to its UPLINK_TASK's request id."""
        self.arrivals.task_heard[task_id] = time.monotonic()
        if isinstance(msg, (m.Completed, m.Failed)):
            self.arrivals.task_final[task_id] = (n, msg)
            if self.state.task(task_id) is not None:  # one of ours: keep the task list current
                if isinstance(msg, m.Completed):
                    self.state.update_task(task_id, state="completed")
                else:
                    state = "cancelled" if msg.code == ResponseCode.CANCELLED else "failed"
                    self.state.update_task(task_id, state=state, code=msg.code.name, reason=msg.reason)
        if task_id in self.arrivals.watched:
            key: tuple
            if isinstance(msg, m.Progress):
                key = (str(msg.phase), msg.done == msg.total)
                text = f"task {task_id}: {msg.phase} {msg.done}/{msg.total}"
            else:
                return
            if self.arrivals.watched[task_id] != key:
                self.arrivals.watched[task_id] = key
                self.notify(text)

    def wait(self, condition: Callable[[], Any], timeout_s: float) -> Any:
        """Pump packets until `condition()` is not None (returned) or `timeout_s` passes (None)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = condition()
            if value is not None:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.pump(min(remaining, 0.5))

    # --- sending ------------------------------------------------------------------------------
    def send(self, message: m.Message, apid: Apid = Apid.PAYLOAD) -> RequestRef:
        seq = self.state.counter.next(apid)
        self.link.send(message, seq, source_id=self.source_id, timeout_s=self.timeout_s, apid=apid)
        _log.debug("ground_sent", type=message.TYPE.name, seq=seq, apid=int(apid))
        return RequestRef(apid=int(apid), source_id=self.source_id, seq=seq, message_type=int(message.TYPE))

    def resync(self, report: m.Rejected) -> None:
        """REPLAYED_SEQUENCE: our counter is behind what the payload has seen from this source
        (lost state, or another ground process using the same source id). Move past it (§6.4).
        SEQUENCE_TOO_FAR_AHEAD: it ran beyond the payload's forward window; continue just after
        the payload's highest accepted number instead."""
        highest = report.highest_seq
        assert highest is not None  # callers resynchronise only on reports that carry it
        if report.code == ResponseCode.SEQUENCE_TOO_FAR_AHEAD:
            self.state.counter.rebase(Apid.PAYLOAD, highest)
            self.notify(
                f"payload reports sequence {report.tc_seq} as too far ahead of its highest accepted "
                f"{report.highest_seq}; sequence counter rebased, sending again"
            )
            return
        self.state.counter.advance_past(Apid.PAYLOAD, highest)
        self.notify(
            f"payload reports sequence {report.tc_seq} as already used (highest accepted {report.highest_seq}); "
            "sequence counter moved past it, sending again"
        )

    def rejection(self, what: str, report: m.Rejected | m.Failed) -> CommandRejected:
        by = "bus" if report.request in self.arrivals.refused_by_bus else "payload"
        return CommandRejected(what, report.code, report.reason, failed=isinstance(report, m.Failed), by=by)

    def silence(self, what: str, waited_s: float) -> str:
        if self.payload_on is False:
            cause = f" ({self.power_cause})" if self.power_cause else ""
            return (
                f"{what}: no answer within {waited_s:g} s: the bus reports the payload powered off{cause}; "
                "commands are queued at the bus"
            )
        return f"{what}: no answer within {waited_s:g} s: payload not answering; commands are queued at the bus"

    def verdict(self, refs: list[RequestRef], want: type) -> m.Verification | None:
        """A Rejected/Failed about any of `refs`, else a report of class `want`, else None."""
        found = None
        for ref in refs:
            for _, report in self.arrivals.reports.get(ref, ()):
                if isinstance(report, (m.Rejected, m.Failed)):
                    return report
                if found is None and isinstance(report, want):
                    found = report
        return found

    def log_command(
        self, command: str, what: str, started: float, seqs: list[int] | None, code: str, text: str = "", **extra: Any
    ) -> None:
        """One line in the station's shared command log (ground/state.py, docs/ground.md "Command
        log"): every command sent by any `ow ground` process of this station, with its answer
        code and round trip. A log that cannot be written never fails the command: said once."""
        entry = {
            "t": round(started, 6),
            "station": self.station,
            "source_id": self.source_id,
            "origin": self.origin,
            "pid": os.getpid(),
            "command": command,
            "what": what,
            "code": code,
            "ok": code == "OK",
            "rtt_ms": round((time.time() - started) * 1000, 1),
            **extra,
        }
        if seqs is not None:
            entry.update(seq=seqs, sends=len(seqs))
        if text:
            entry["text"] = text
        try:
            self.state.log_command(entry)
        except (OSError, LocalInputError) as exc:
            if not self._log_failed:
                self._log_failed = True
                self.notify(f"command log {self.state.command_log_path} not written: {exc}")

    def transact(
        self,
        message: m.Message,
        what: str,
        *,
        reply: Callable[[int], Any] | None = None,
        completion: bool = False,
        retries: int = 0,
        on_send: Callable[[RequestRef], None] | None = None,
        apid: Apid = Apid.PAYLOAD,
    ) -> tuple[RequestRef, Any]:
        """Send `message` and wait for its outcome: `reply(mark)` not None (a reply packet that
        arrived after `mark`), else COMPLETED (`completion`) or ACCEPTED. REJECTED/FAILED raise
        CommandRejected, except REPLAYED_SEQUENCE, which resynchronises and sends again. With
        `retries`, an unanswered command is sent again (only for idempotent commands); reports
        about any of the copies count. `apid`: who the command is for (the bus takes PAYLOAD_RETRY)."""
        sent: list[int] = []
        started = time.time()

        def counted(ref: RequestRef) -> None:
            sent.append(ref.seq)
            if on_send is not None:
                on_send(ref)

        task_id = getattr(message, "task_id", None)
        extra = {"task_id": task_id} if isinstance(task_id, str) else {}
        try:
            result = self._transact_once(message, what, reply, completion, retries, counted, apid)
        except CommandRejected as exc:
            # RESULT_NOT_READY is the payload's "not yet" to a running task's DOWNLINK_RESULT (§3.6)
            answer = dict(extra, by=exc.by, failed=exc.failed, not_yet=exc.code == ResponseCode.RESULT_NOT_READY)
            self.log_command(message.TYPE.name, what, started, sent, exc.code.name, exc.reason, **answer)
            raise
        except NoAnswer as exc:
            self.log_command(message.TYPE.name, what, started, sent, "NO_ANSWER", str(exc), **extra)
            raise
        except BaseException as exc:  # Ctrl-C, the link failing: still a command sent, or tried
            self.log_command(message.TYPE.name, what, started, sent, type(exc).__name__, str(exc), **extra)
            raise
        self.log_command(message.TYPE.name, what, started, sent, "OK", **extra)
        return result

    def _transact_once(
        self,
        message: m.Message,
        what: str,
        reply: Callable[[int], Any] | None,
        completion: bool,
        retries: int,
        on_send: Callable[[RequestRef], None],
        apid: Apid,
    ) -> tuple[RequestRef, Any]:
        refs: list[RequestRef] = []
        mark = self.arrivals.count
        stalls = resyncs = 0
        want = m.Completed if completion else m.Accepted
        while True:
            ref = self.send(message, apid)
            refs.append(ref)
            on_send(ref)

            def outcome():
                verdict = self.verdict(refs, want)
                if isinstance(verdict, (m.Rejected, m.Failed)):
                    return verdict
                if reply is not None:
                    value = reply(mark)
                    return None if value is None else (refs[-1], value)
                return None if verdict is None else (verdict.request, verdict)

            result = self.wait(outcome, self.timeout_s)
            if result is None:
                stalls += 1
                if stalls > retries:
                    raise NoAnswer(self.silence(what, self.timeout_s))
                self.notify(f"{self.silence(what, self.timeout_s)}; sending again ({stalls}/{retries})")
                continue
            if isinstance(result, m.Rejected):
                if result.code in RESYNC_CODES and result.highest_seq is not None and resyncs < 3:
                    resyncs += 1
                    refs.remove(result.request)
                    self.resync(result)
                    continue
                raise self.rejection(what, result)
            if isinstance(result, m.Failed):
                raise CommandRejected(what, result.code, result.reason, failed=True)
            return result


def after(entry: tuple | None, mark: int) -> Any:
    """The value of an (arrival number, value) entry that arrived after `mark`, else None."""
    return entry[1] if entry is not None and entry[0] > mark else None
