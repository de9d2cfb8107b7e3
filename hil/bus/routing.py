"""Reply routing: every report of the payload goes back to the ground connection that sent the
telecommand it answers (else that station's latest connection), and into the run log
(docs/bus.md §5). Verification reports carry their request id; PONG, HOUSEKEEPING, TASK_RESULT
and IMAGE_STATUS do not, and are matched to the telecommand that asked for them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from common.wire import MessageType, ResponseCode
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.link import LinkError, send_packet
from hil.bus import buslog as bl
from hil.bus.base import BusIO, GroundExchanges, RequestKey, request_fields
from hil.bus.busstore import StoredCommand, request_key

#: Replies that answer one telecommand, and the field that ties reply to command.
REPLY_TO = {
    MessageType.PING: (MessageType.PONG, "key"),
    MessageType.STATUS: (MessageType.HOUSEKEEPING, None),
    MessageType.DOWNLINK_RESULT: (MessageType.TASK_RESULT, "task_id"),
    MessageType.IMAGE_QUERY: (MessageType.IMAGE_STATUS, "image"),
}
#: How long an unanswered reply expectation is kept (wall seconds).
REPLY_EXPECTATION_S = 600.0
#: Routing entries kept for reports of earlier telecommands.
ROUTES_KEPT = 100_000


@dataclass
class ReplyExpectation:
    """A reply the payload owes a telecommand (`reply` whose `field_name` equals `value`)."""

    reply: MessageType
    field_name: str | None
    value: Any
    key: tuple[int, int, int, int]
    source_id: int
    created: float
    #: the command has been sent to the payload: an answer can only come after that
    armed: bool = False


class Routing:
    """Where each ground connection is, which task is whose, and the replies still owed."""

    def __init__(self, io: BusIO, exchanges: GroundExchanges):
        self.io = io
        #: the payload's answers, and whom they reached, for skip-idle
        self.exchanges = exchanges
        # routing of reports back to the ground connection that sent the telecommand
        self.route_by_request: dict[tuple, bytes] = {}
        self.route_by_source: dict[int, bytes] = {}
        self.task_owner: dict[str, tuple] = {}
        self.expectations: list[ReplyExpectation] = []

    def confirm_stored(self, entry: StoredCommand, how: str, now: float | None = None) -> None:
        """A stored command is done with (answered, assumed delivered, dropped): out of the store,
        and a `command_confirmed` line saying how."""
        self.io.store.confirm(entry, how)
        self.io.buslog.write(
            bl.COMMAND_CONFIRMED,
            **self.io.stamp(now),
            store_id=entry.store_id,
            type=entry.type_name,
            request=request_fields(entry.request),
            how=how,
        )

    def expect_replies(self, request: RequestRef, message: m.Message) -> None:
        """Note what the payload will answer this telecommand with, to route the answer back."""
        if isinstance(message, m.UplinkTask):
            self.task_owner[message.task_id] = request_key(request)
        reply = REPLY_TO.get(message.TYPE)
        if reply is not None:
            reply_type, field_name = reply
            self.expectations.append(
                ReplyExpectation(
                    reply_type,
                    field_name,
                    getattr(message, field_name) if field_name else None,
                    request_key(request),
                    request.source_id,
                    time.monotonic(),
                )
            )

    def remember_route(self, request: RequestRef, routing_id: bytes) -> None:
        routes = self.route_by_request
        routes[request_key(request)] = routing_id
        if len(routes) > ROUTES_KEPT:
            for key in list(routes)[: len(routes) - ROUTES_KEPT]:
                del routes[key]
        self.route_by_source[request.source_id] = routing_id

    def arm(self, key: tuple) -> None:
        """The command `key` went to the payload: an answer to it can come from now on."""
        for expectation in self.expectations:
            if expectation.key == key:
                expectation.armed = True

    def owed_answers(self, now: float) -> dict[int, tuple[str | None, set[RequestKey]]]:
        """What the payload's earlier connections still owe the ground, by station (source id ->
        (key name, request keys)): commands sent to the payload and not confirmed, and replies
        owed to commands it took. Asked when a new connection comes (after a cut, a bus restart or
        a lost link): those answers may have gone with the old one (docs/bus.md §1)."""
        owed: dict[int, tuple[str | None, set[RequestKey]]] = {}
        for entry in self.io.store.pending():
            if entry.forwards > 0:
                _, keys = owed.setdefault(entry.request.source_id, (entry.sender, set()))
                keys.add(entry.key)
        for expectation in self.expectations:
            if expectation.armed and now - expectation.created < REPLY_EXPECTATION_S:
                _, keys = owed.setdefault(expectation.source_id, (None, set()))
                keys.add(expectation.key)
        return owed

    def _to_ground(self, packet: bytes, key: RequestKey | None, source_id: int | None) -> bool:
        """Send to the connection that sent the telecommand, else to that station's latest."""
        candidates = []
        if key is not None and key in self.route_by_request:
            candidates.append(self.route_by_request[key])
        if source_id is not None and source_id in self.route_by_source:
            candidates.append(self.route_by_source[source_id])
        for rid in dict.fromkeys(candidates):
            try:
                send_packet(self.io.commands_sock, packet, routing_id=rid, timeout_s=0.1)
            except LinkError:
                continue
            if key is not None:
                self.exchanges.answered(key)
            return True
        return False

    def route_payload_report(self, message: m.Message, packet: bytes, now: float) -> bool:
        """Route one report of the payload; True when it is a redelivery duplicate, which goes
        nowhere beyond the run log."""
        if isinstance(message, m.Verification):
            request = message.request
            key = request_key(request)
            code = getattr(message, "code", None)
            suppressed = False
            entry = self.io.store.find(key)
            if entry is not None:
                how = message.TYPE.name.lower()
                if code == ResponseCode.REPLAYED_SEQUENCE and entry.forwards > 1:
                    # A redelivery the payload had already accepted before it lost power: the
                    # command ran once; the ground gets the payload's other reports about it.
                    how, suppressed = "redelivery_duplicate", True
                self.confirm_stored(entry, how, now)
            if message.TYPE in (MessageType.REJECTED, MessageType.FAILED, MessageType.COMPLETED):
                self.expectations = [e for e in self.expectations if e.key != key]
            self.exchanges.exchanged(now)  # an answer, even one the ground does not get (a duplicate)
            routed = False if suppressed else self._to_ground(packet, key, request.source_id)
            progress: dict[str, Any] = (
                {"phase": message.phase.value, "done": message.done, "total": message.total}
                if isinstance(message, m.Progress)
                else {}
            )
            self.io.buslog.write(
                bl.PAYLOAD_REPORT,
                **self.io.stamp(now),
                type=message.TYPE.name,
                request=request_fields(request),
                task_id=message.task_id,
                code=ResponseCode(code).name if code is not None else None,  # type: ignore[call-arg]
                routed=routed,
                **progress,
            )
            return suppressed
        if message.TYPE in (
            MessageType.PONG,
            MessageType.HOUSEKEEPING,
            MessageType.TASK_RESULT,
            MessageType.IMAGE_STATUS,
        ):
            self._route_reply(message, packet, now)
        elif isinstance(message, m.Event):
            self.io.buslog.write(
                bl.PAYLOAD_REPORT,
                **self.io.stamp(now),
                type="EVENT",
                event=message.event_id.name,
                task_id=message.task_id,
                text=message.text[:200],
            )
        return False

    def _route_reply(self, message: m.Message, packet: bytes, now: float) -> None:
        self.expectations = [e for e in self.expectations if now - e.created < REPLY_EXPECTATION_S]
        match = None
        for expectation in self.expectations:
            if expectation.reply != message.TYPE or not expectation.armed:
                continue
            if expectation.field_name is None or getattr(message, expectation.field_name) == expectation.value:
                match = expectation
                break
        key = source = None
        if match is not None:
            self.expectations.remove(match)
            key, source = match.key, match.source_id
        elif isinstance(message, m.TaskResult) and message.task_id in self.task_owner:
            key = self.task_owner[message.task_id]
            source = key[1]
        # A task's answer goes into the run log in full (a replay compares it bit for bit).
        result: dict[str, Any] = (
            {
                "token_ids": list(message.token_ids),
                "logits_sha256": bytes(message.logits_sha256).hex(),
                "interruptions": message.interruptions,
            }
            if isinstance(message, m.TaskResult)
            else {}
        )
        if key is None:
            if isinstance(message, m.TaskResult):
                self.io.buslog.write(
                    bl.PAYLOAD_REPORT,
                    **self.io.stamp(now),
                    type=message.TYPE.name,
                    request=None,
                    task_id=message.task_id,
                    code=None,
                    routed=False,
                    **result,
                )
            return  # periodic housekeeping: telemetry only
        self.exchanges.exchanged(now)
        routed = self._to_ground(packet, key, source)
        self.io.buslog.write(
            bl.PAYLOAD_REPORT,
            **self.io.stamp(now),
            type=message.TYPE.name,
            request=request_fields(RequestRef(*key)),
            task_id=getattr(message, "task_id", None),
            code=None,
            routed=routed,
            **result,
        )
