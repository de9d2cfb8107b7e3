"""Telecommand dispatch (cFS style): every packet from the bus is decoded, replay-checked and
handed to one handler per opcode (handlers.py); every handler either accepts (`Verdicts.accept`:
counted, replay guard persisted, ACCEPTED) or raises WireError, which becomes REJECTED with its
code. PING and STATUS are answered on the main thread, from memory; everything else runs on the
command thread (jobs.py), in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.wire import EventId, MessageType, ReplayError, RequestRef, ResponseCode, StorageState, WireError
from common.wire import decode as decode_packet
from common.wire import messages as m
from common.wire.errors import clip_reason

from .health import Health, command_item
from .jobs import CommandJobs
from .outbox import Outbox
from .queue import TaskQueue
from .reports import Faults, current_slot
from .state import PersistentState
from .storage import Storage

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

Handler = Callable[[Any, Any], None]


class Verdicts:
    """ACCEPTED and REJECTED, with the counters and the replay guard they change."""

    def __init__(self, state: PersistentState, storage: Storage, outbox: Outbox, log: Any):
        self.state = state
        self.storage = storage
        self.outbox = outbox
        self.log = log

    def accept(self, request: RequestRef, **fields: Any) -> None:
        """The command is valid: count it and acknowledge it. A command that changes state has
        its replay guard and counters saved first (on the command thread); a query's are saved
        with the next write. If the disk refuses that save, the command's own effect is already
        durable and every handler is idempotent for a repeated number, so it is still
        acknowledged, and the state stays dirty until the disk takes it."""
        self.state.count_command()
        if request.message_type not in QUERIES:
            try:
                self.state.save()
            except OSError as exc:
                if not self.storage.failed(exc, "saving the replay guard"):
                    raise
        self.outbox.send(m.Accepted.about(request, **fields))

    def reject(self, report: m.Rejected, code: ResponseCode) -> None:
        """A rejection changes nothing to protect: its counter is saved with the next write.
        RESULT_NOT_READY to a DOWNLINK_RESULT is the answer "not yet" to a valid query about a
        task that has not finished (a ground waiting for a result asks it), not a fault: it is
        neither counted in ERROR_COUNT nor logged as a rejection (docs/wire-protocol.md)."""
        if report.not_yet:
            self.log.info("result_not_ready", reason=report.reason)
            self.outbox.send(report)
            return
        self.state.count_error()
        self.log.warning("command_rejected", code=ResponseCode(code).name, reason=report.reason)
        self.outbox.send(report)


class Dispatcher:
    """A packet from the bus to its handler (main thread; the command thread for what writes)."""

    def __init__(
        self,
        *,
        handlers: dict[MessageType, Handler],
        verdicts: Verdicts,
        state: PersistentState,
        health: Health,
        storage: Storage,
        queue: TaskQueue,
        jobs: CommandJobs,
        outbox: Outbox,
        faults: Faults,
    ):
        self.handlers = handlers
        self.verdicts = verdicts
        self.state = state
        self.health = health
        self.storage = storage
        self.queue = queue
        self.jobs = jobs
        self.outbox = outbox
        self.faults = faults

    def handle_packet(self, data: bytes) -> None:
        """A packet from the bus (main thread). Decoding, the replay guard and the quarantine are
        in memory; PING and STATUS are answered here, everything else runs on the command thread
        (or here, when no command thread runs: in-process tests and fuzzers)."""
        try:
            header, message = decode_packet(data)
        except WireError as err:
            self.verdicts.reject(m.Rejected.from_error(err), err.code)
            return
        if not message.is_command():
            # the bus's own messages (warnings, power state, telemetry the cadence reads); any
            # other telemetry type sent to the payload is ignored
            bus_handler = self.handlers.get(message.TYPE)
            if bus_handler is None:
                return
            if isinstance(message, m.PowerStateChange):
                # its verdict counts abnormal exits: a durable write, the command thread's to do
                self.jobs.later(lambda: bus_handler(header, message))
            else:
                bus_handler(header, message)  # warnings and telemetry change memory only
            return
        request = header.request
        at_once = message.TYPE in ANSWERED_AT_ONCE
        if not self._replay_checked(request, record=at_once):
            return
        item = command_item(message)
        if self.health.is_quarantined(item):
            self.verdicts.reject(
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
            self.jobs.later(lambda: self._dispatch_in_turn(request, message, item))

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
                    self.state.mark_unsaved()
                else:
                    self.state.guard.check(request.apid, request.source_id, request.seq)
        except ReplayError as err:
            what = "replayed" if err.code == ResponseCode.REPLAYED_SEQUENCE else "far-ahead"
            self.outbox.event(
                EventId.REPLAY_DETECTED, f"{what} {MessageType(request.message_type).name} seq {request.seq}"
            )
            self.verdicts.reject(m.Rejected.from_error(err, request), err.code)
            return False
        return True

    def _storage_refusal(self, message: m.Message) -> WireError | None:
        """Why a telecommand that needs the disk is refused now, without trying it (None: try).
        A full disk refuses what would grow it (a new task, an image chunk); a read-only or
        failing one refuses every command that changes state."""
        growth = isinstance(message, m.ImageChunk) or (
            isinstance(message, m.UplinkTask)
            and self.queue.live(message.task_id) is None
            and self.queue.finished(message.task_id) is None
        )
        if not growth and message.TYPE not in STATE_CHANGING:
            return None
        condition = self.storage.condition()  # state and reason as one pair: another thread may change it
        if condition.refusal_errno(growth) is None:
            return None
        return WireError(
            STORAGE_CODES[condition.state],
            f"payload storage is {condition.state.value}: {message.TYPE.name} refused until it "
            f"can be written again ({condition.reason})",
        )

    def _dispatch(self, request: RequestRef, message: m.Message, item: str) -> None:
        """One telecommand to its handler; whatever it raises becomes a REJECTED with a code."""
        task_id = getattr(message, "task_id", None)
        handler = self.handlers.get(message.TYPE)
        try:
            refusal = self._storage_refusal(message)
            if refusal is not None:
                raise refusal
            with self.health.handling(item, current_slot()):
                if handler is None:
                    raise WireError(ResponseCode.UNKNOWN_COMMAND, f"no handler for {message.TYPE.name}")
                handler(request, message)
        except WireError as err:
            self.verdicts.reject(m.Rejected.from_error(err, request, task_id), err.code)
        except OSError as exc:
            # The disk refused (full, read-only, I/O error): the environment's doing, reported
            # through the storage state and never counted against the command.
            code = ResponseCode.INTERNAL_ERROR
            if self.storage.failed(exc, f"{message.TYPE.name} handler"):
                code = STORAGE_CODES.get(self.storage.condition().state, ResponseCode.STORAGE_FULL)
            self.verdicts.reject(
                m.Rejected.about(
                    request, code=code, reason=clip_reason(f"{type(exc).__name__}: {exc}"), task_id=task_id
                ),
                code,
            )
        except Exception as exc:  # noqa: BLE001 - a handler defect rejects this command, nothing more
            self.faults.fault(EventId.COMMAND_FAULT, f"{message.TYPE.name} handler failed", exc, item)
            self.verdicts.reject(
                m.Rejected.about(
                    request,
                    code=ResponseCode.HANDLER_FAULT,
                    task_id=task_id,
                    reason=clip_reason(f"{type(exc).__name__}: {exc}"),
                ),
                ResponseCode.HANDLER_FAULT,
            )


__all__ = ["ANSWERED_AT_ONCE", "Dispatcher", "QUERIES", "STATE_CHANGING", "STORAGE_CODES", "Verdicts"]
