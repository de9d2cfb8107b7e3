"""The relay between ground and payload: telecommands from the commands link are checked, stored
durably (hil.busstore) and forwarded in order to the current payload connection, at most
`max_in_flight` unconfirmed; what the payload sends is published, keeps its link alive and is
routed back (hil/bus/routing.py). docs/bus.md §5."""

from __future__ import annotations

import base64
import time
from typing import Any

from common import log
from common.wire import Apid, FdirMode, PowerCause, ResponseCode, WireError, decode
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.link import LinkError, Received, send_packet
from hil import buslog as bl
from hil.bus.base import request_fields
from hil.bus.routing import RoutingPart
from hil.busstore import StoredCommand, request_key

_log = log.get("hil.bus")

#: Source ids a ground station may use (docs/wire-protocol.md §5.1).
GROUND_SOURCE_IDS = range(0x0001, 0x0100)


class RelayPart(RoutingPart):
    """Ground packets in, stored commands out to the payload, payload packets in."""

    def _ground_allowed(self, user: str | None) -> bool:
        if user is None or user == self.config.payload_client:
            return False
        allowed = self.config.ground_clients
        return allowed is None or user in allowed

    def _reject_ground(
        self,
        received: Received,
        error: WireError,
        request: RequestRef | None = None,
        task_id: str | None = None,
        type_name: str | None = None,
    ) -> None:
        report = m.Rejected.from_error(error, request, task_id)
        packet = self._bus_packet(report)
        self._publish(packet)
        try:
            send_packet(self.commands_sock, packet, routing_id=received.routing_id, timeout_s=0.1)
        except LinkError:
            pass
        req = report.request
        self.buslog.write(
            bl.COMMAND_REJECTED,
            **self._stamp(),
            request=request_fields(req),
            type=type_name,
            task_id=task_id,
            code=error.code.name,
            reason=error.reason,
            sender=received.user_id,
        )
        _log.warning("bus_command_rejected", code=error.code.name, reason=error.reason, sender=received.user_id)

    def _on_ground_packet(self, received: Received) -> None:
        packet = received.packet
        if not self._ground_allowed(received.user_id):
            refused: RequestRef | None
            try:
                refused = decode(packet)[0].request
            except WireError as exc:
                refused = exc.request
            self.buslog.write(bl.LINK_REFUSED, **self._stamp(), link="commands", client=received.user_id)
            self._reject_ground(
                received,
                WireError(ResponseCode.NOT_AUTHORIZED, f"client {received.user_id!r} may not command the payload"),
                refused,
            )
            return
        try:
            header, message = decode(packet)
        except WireError as exc:
            self._reject_ground(received, exc)
            return
        request = header.request
        task_id = getattr(message, "task_id", None)
        name = message.TYPE.name
        if not message.is_command():
            self._reject_ground(
                received,
                WireError(ResponseCode.WRONG_PACKET_TYPE, f"{name} is telemetry; the commands link takes telecommands"),
                request,
                task_id,
                name,
            )
            return
        if header.apid != Apid.PAYLOAD:
            self._reject_ground(
                received,
                WireError(
                    ResponseCode.WRONG_APID,
                    f"APID {header.apid:#05x}: telecommands go to the payload ({int(Apid.PAYLOAD):#05x})",
                ),
                request,
                task_id,
                name,
            )
            return
        if header.source_id not in GROUND_SOURCE_IDS:
            self._reject_ground(
                received,
                WireError(ResponseCode.NOT_AUTHORIZED, f"source id {header.source_id:#06x} is not a ground station's"),
                request,
                task_id,
                name,
            )
            return
        if self.store.find(request_key(request)) is not None:
            self._reject_ground(
                received,
                WireError(
                    ResponseCode.REPLAYED_SEQUENCE,
                    f"seq {request.seq} from source {request.source_id} is already queued",
                ),
                request,
                task_id,
                name,
            )
            return
        # _ground_allowed refused a client without a name; a ROUTER socket names every sender.
        assert received.user_id is not None and received.routing_id is not None
        entry = self.store.enqueue(packet, received.user_id, time.time())
        self.store.flush()  # durable before anything else happens to it (or is logged about it)
        self._remember_route(request, received.routing_id)
        self._expect_replies(request, message)
        extra: dict[str, Any] = {"packet": base64.b64encode(packet).decode("ascii")} if self.config.log_packets else {}
        self.buslog.write(
            bl.COMMAND_RECEIVED,
            **self._stamp(),
            request=request_fields(request),
            type=name,
            task_id=task_id,
            sender=received.user_id,
            store_id=entry.store_id,
            payload_on=self.switch.is_on(),
            payload_connected=self.payload_rid is not None,
            queued=len(self.store),
            **extra,
        )
        _log.info(
            "bus_command_received",
            type=name,
            seq=request.seq,
            source=request.source_id,
            task_id=task_id,
            store_id=entry.store_id,
            queued=len(self.store),
        )

    def _forward(self) -> None:
        """Send live commands in order to the current payload connection, at most
        max_in_flight unconfirmed at a time; each is marked durably before it is sent."""
        if self.payload_rid is None or not self.switch.is_on() or not len(self.store):
            return
        pending = self.store.pending()
        in_flight = sum(1 for e in pending if e.sent_link == self.link_id)
        batch: list[StoredCommand] = []
        for entry in pending:
            if entry.sent_link == self.link_id:
                continue
            if in_flight + len(batch) >= self.config.max_in_flight:
                break
            batch.append(entry)
        if not batch:
            return
        self.payload_queue_depth = None  # a command may add work: wait for the next housekeeping report
        for entry in batch:
            self.store.mark_forwarded(entry, self.link_id)
        self.store.flush()
        for entry in batch:
            if not self._to_payload(entry.packet):
                return
            entry.sent_link, entry.sent_at = self.link_id, time.monotonic()
            for expectation in self.expectations:
                if expectation.key == entry.key:
                    expectation.armed = True
            self.buslog.write(
                bl.COMMAND_FORWARDED,
                **self._stamp(),
                store_id=entry.store_id,
                type=entry.type_name,
                request=request_fields(entry.request),
                task_id=entry.task_id,
                link=self.link_id,
                redelivery=entry.forwards > 1,
            )

    def _on_payload_packet(self, received: Received) -> None:
        now = time.monotonic()
        if received.user_id != self.config.payload_client:
            self.buslog.write(bl.LINK_REFUSED, **self._stamp(now), link="payload", client=received.user_id)
            _log.warning("bus_payload_link_refused", client=received.user_id)
            refused: RequestRef | None
            try:
                refused = decode(received.packet)[0].request
            except WireError as exc:
                refused = exc.request
            report = m.Rejected.from_error(
                WireError(ResponseCode.NOT_AUTHORIZED, f"client {received.user_id!r} is not the payload"), refused
            )
            try:
                send_packet(self.payload_sock, self._bus_packet(report), routing_id=received.routing_id, timeout_s=0.1)
            except LinkError:
                pass
            return
        try:
            header, message = decode(received.packet)
        except WireError as exc:
            _log.warning("bus_payload_packet_bad", code=exc.code.name, reason=exc.reason)
            return
        if message.is_command():
            _log.warning("bus_payload_sent_command", type=message.TYPE.name)
            return
        if self.switch.is_on() and received.routing_id != self.payload_rid:
            self._payload_connected(received.routing_id, message, now)
        if self.pacer is not None:
            self.pacer.payload_message(self, message, now)
        if received.routing_id == self.payload_rid:
            if self.last_seen is not None and now - self.last_seen > self.config.heartbeat_gap_log_s:
                self.buslog.write(
                    bl.HEARTBEAT_GAP,
                    **self._stamp(now),
                    gap_s=round(now - self.last_seen, 3),
                    action="none",
                    phase="running",
                )
                if self.fdir_mode is FdirMode.DEGRADED:
                    self.fdir_mode = FdirMode.NOMINAL
            self.last_seen = now
            self.gap_reported = False
            if isinstance(message, m.Housekeeping):
                self.payload_queue_depth = message.queue_depth
            if isinstance(message, m.Heartbeat):
                self._confirm_by_time(now)
                if message.current_task is None:
                    self.payload_idle_since = self.payload_idle_since or now
                else:
                    self.payload_idle_since = None
        self._publish(received.packet)
        self._route_payload_report(message, received.packet, now)

    def _payload_connected(self, rid: bytes | None, message: m.Message, now: float) -> None:
        if self.config.hold_for_connect:
            self.clock.release(now)  # the window's trace time starts now
        self.link_id += 1
        self.payload_rid = rid
        self.last_seen = now
        self.payload_idle_since = None
        self.payload_queue_depth = None  # unknown until its next housekeeping report
        boot_count = message.boot_count if isinstance(message, m.Heartbeat) else None
        self.buslog.write(
            bl.PAYLOAD_CONNECTED,
            **self._stamp(now),
            link=self.link_id,
            boot_count=boot_count,
            after_power_on_s=round(now - self.powered_at, 3) if self.powered_at else None,
            queued=len(self.store),
        )
        _log.info("bus_payload_connected", link=self.link_id, boot_count=boot_count, queued=len(self.store))
        self._to_payload(
            self._bus_packet(
                m.PowerStateChange(
                    trace_time_s=self.clock.clock_s(now),
                    payload_on=True,
                    cause=PowerCause.RESTORED,
                    after_fault=self.last_off_fault,
                )
            )
        )
        if self.pending_warning is not None:
            self._warn(redelivered=True)

    def _confirm_by_time(self, now: float) -> None:
        """Telecommands that asked for no acceptance report cannot be confirmed by one: once the
        payload has lived `confirm_after_s` after receiving one, it counts as delivered."""
        for entry in self.store.pending():
            if (
                entry.sent_link == self.link_id
                and entry.sent_at is not None
                and now - entry.sent_at >= self.config.confirm_after_s
                and not entry.wants_acceptance
            ):
                self.store.confirm(entry, "assumed")
                self.buslog.write(
                    bl.COMMAND_CONFIRMED,
                    **self._stamp(now),
                    store_id=entry.store_id,
                    type=entry.type_name,
                    request=request_fields(entry.request),
                    how="assumed",
                )
