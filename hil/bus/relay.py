"""The relay between ground and payload: telecommands from the commands link are checked (key,
source binding, rate, quota, bounds), stored durably (hil.bus.busstore) and forwarded to the current
payload connection -- round-robin between the stations' queues, each station's in order, at most
`max_in_flight` unconfirmed in all; what the payload sends is published, keeps its link alive and
is routed back (hil/bus/routing.py). docs/bus.md §5."""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from common import log
from common.wire import (
    Apid,
    FdirMode,
    MessageType,
    PacketHeader,
    PowerCause,
    ResponseCode,
    WireError,
    decode,
    decode_header,
)
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.ids import GROUND_SOURCE_IDS, is_admin_source
from common.wire.link import LinkError, Received, send_packet
from hil.bus import buslog as bl
from hil.bus.base import BusIO, FdirChannels, GroundExchanges, PayloadLink, request_fields
from hil.bus.busstore import StoredCommand, StoreUnavailable, request_key
from hil.bus.clock import TraceClock
from hil.bus.config import BusConfig
from hil.bus.power_fdir import PowerFdir
from hil.bus.routing import Routing
from hil.bus.stations import Stations
from hil.bus.storage import STORAGE_RETRY_S, StorageWatch, condition_of
from hil.bus.timeline import Timeline

_log = log.get("hil.bus")

__all__ = ["GROUND_SOURCE_IDS", "Relay"]

_STORE_WRITER = "command store"
_CONDITION_WORDS = {"full": "full", "read_only": "read-only", "error": "failing (I/O errors)"}


class Relay:
    """Ground packets in, stored commands out to the payload, payload packets in."""

    def __init__(
        self,
        config: BusConfig,
        clock: TraceClock,
        io: BusIO,
        link: PayloadLink,
        fdir: FdirChannels,
        storage: StorageWatch,
        power: PowerFdir,
        timeline: Timeline,
        routing: Routing,
        stations: Stations,
        exchanges: GroundExchanges,
        on_payload_message: Callable[[m.Message, float], None] | None = None,
    ):
        self.config = config
        self.clock = clock
        self.io = io
        self.link = link
        self.fdir = fdir
        self.storage = storage
        self.power = power
        self.timeline = timeline
        self.routing = routing
        self.stations = stations
        #: the ground's commands and the stations a cut left waiting, for skip-idle
        self.exchanges = exchanges
        #: sees every packet from the payload (a replay's pacer)
        self.on_payload_message = on_payload_message
        # when the failing command store and run log are tried again (monotonic)
        self._store_retry_at = 0.0
        self._log_retry_at = 0.0
        #: the station served last by the round-robin forwarder
        self._served_last: str | None = None

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
        *,
        link_refused: bool = False,
    ) -> None:
        report = m.Rejected.from_error(error, request, task_id)
        packet = self.io.bus_packet(report)
        sender = received.user_id or "unknown"
        # Past REJECT_LOG_BURST in a window, a station's refusals are answered to it alone and
        # counted: a flood of bad packets must not become a flood of log lines and telemetry.
        in_full = self.stations.log_rejection(sender, error.code.name, time.monotonic())
        if in_full:
            self.io.publish(packet)
            if link_refused:
                self.io.buslog.write(bl.LINK_REFUSED, **self.io.stamp(), link="commands", client=received.user_id)
        try:
            send_packet(
                self.io.commands_sock, packet, routing_id=received.routing_id, timeout_s=0.0 if not in_full else 0.1
            )
        except LinkError:
            pass
        if not in_full:
            return
        req = report.request
        self.io.buslog.write(
            bl.COMMAND_REJECTED,
            **self.io.stamp(),
            request=request_fields(req),
            type=type_name,
            task_id=task_id,
            code=error.code.name,
            reason=error.reason,
            sender=received.user_id,
        )
        _log.warning("bus_command_rejected", code=error.code.name, reason=error.reason, sender=received.user_id)

    def on_ground_packet(self, received: Received) -> None:
        packet = received.packet
        now = time.monotonic()
        user = received.user_id
        if not self._ground_allowed(user):
            self._reject_ground(
                received,
                WireError(ResponseCode.NOT_AUTHORIZED, f"client {user!r} may not command the payload"),
                self._header_request(packet),
                link_refused=True,
            )
            return
        assert user is not None  # _ground_allowed refused a client without a name
        if not self.stations.key_current(user, received.key):
            self._reject_ground(
                received,
                WireError(
                    ResponseCode.NOT_AUTHORIZED,
                    f"key {user!r} was revoked (no longer in authorized/); this connection is closed",
                ),
                self._header_request(packet),
            )
            self.stations.close_revoked("commands", received.routing_id, received)
            return
        self.stations.note_connection("commands", received.routing_id, received)
        self.exchanges.exchanged(now)  # a station at work: skip-idle waits for it to be quiet
        if not self.stations.rate_ok(user, now):
            rate = self.config.station_rate
            self._reject_ground(
                received,
                WireError(
                    ResponseCode.RATE_LIMITED,
                    f"station {user} sends faster than {rate:g} commands/s (burst {self.config.station_burst}); "
                    "slow down and send again",
                ),
                self._header_request(packet),
            )
            self.stations.throttled(user, None, f"RATE_LIMITED, more than {rate:g} commands/s", now)
            return
        try:
            header, message = decode(packet)
        except WireError as exc:
            self._reject_ground(received, exc)
            return
        request = header.request
        task_id = getattr(message, "task_id", None)
        name = message.TYPE.name

        def refuse(code: ResponseCode, reason: str) -> None:
            self._reject_ground(received, WireError(code, reason), request, task_id, name)

        if not message.is_command():
            refuse(ResponseCode.WRONG_PACKET_TYPE, f"{name} is telemetry; the commands link takes telecommands")
            return
        if header.apid not in (Apid.PAYLOAD, Apid.BUS):
            refuse(
                ResponseCode.WRONG_APID,
                f"APID {header.apid:#05x}: telecommands go to the payload ({int(Apid.PAYLOAD):#05x}); "
                f"the bus ({int(Apid.BUS):#05x}) takes PAYLOAD_RETRY",
            )
            return
        if header.source_id not in GROUND_SOURCE_IDS:
            refuse(ResponseCode.NOT_AUTHORIZED, f"source id {header.source_id:#06x} is not a ground station's")
            return
        bound = self.stations.binding(user)
        if bound is None:
            refuse(
                ResponseCode.SOURCE_NOT_BOUND,
                f"key {user!r} is bound to no source id; bind it with `ow ground keys authorize {user}` "
                f"(authorized/{user}.station)",
            )
            return
        if header.source_id != bound:
            refuse(
                ResponseCode.SOURCE_NOT_BOUND,
                f"source id {header.source_id:#06x} is not key {user!r}'s: it is bound to {bound:#06x}",
            )
            return
        if header.apid == Apid.BUS or message.TYPE == MessageType.PAYLOAD_RETRY:
            self._on_bus_command(received, header, message)  # the bus's own telecommand, never stored
            return
        if self.io.store.find(request_key(request)) is not None:
            refuse(
                ResponseCode.REPLAYED_SEQUENCE, f"seq {request.seq} from source {request.source_id} is already queued"
            )
            return
        cfg = self.config
        if self.io.store.count_for(user) >= cfg.station_quota:
            refuse(
                ResponseCode.STATION_QUOTA,
                f"station {user} already has {cfg.station_quota} commands stored on the bus (its quota); "
                "send again once the payload has taken some",
            )
            self.stations.throttled(user, header.source_id, f"STATION_QUOTA, {cfg.station_quota} commands stored", now)
            return
        if len(self.io.store) >= cfg.store_max_commands or self.io.store.live_bytes + len(packet) > cfg.store_max_bytes:
            refuse(
                ResponseCode.BUS_STORAGE_FULL,
                f"the bus's command store is at its cap ({len(self.io.store)} commands, "
                f"{self.io.store.live_bytes / 2**20:.1f} MiB of {cfg.store_max_commands} / "
                f"{cfg.store_max_bytes / 2**20:.1f} MiB); not relayed, send it again later",
            )
            return
        try:
            # Durable before anything else happens to it (or is logged about it).
            entry = self.io.store.enqueue(packet, user, time.time())
        except StoreUnavailable as exc:
            self.storage.failed(_STORE_WRITER, exc.error)
            condition = _CONDITION_WORDS.get(condition_of(exc.error), "failing")
            refuse(
                ResponseCode.BUS_STORAGE_FULL,
                f"the bus cannot store the command durably: its disk is {condition} "
                f"({exc.error.strerror or exc.error}); not relayed, send it again later",
            )
            return
        self.storage.succeeded(_STORE_WRITER)  # marks that waited went out with it
        self.exchanges.asked(entry.key)
        assert received.routing_id is not None  # a ROUTER socket names every sender
        self.routing.remember_route(request, received.routing_id)
        self.routing.expect_replies(request, message)
        extra: dict[str, Any] = {"packet": base64.b64encode(packet).decode("ascii")} if self.config.log_packets else {}
        self.io.buslog.write(
            bl.COMMAND_RECEIVED,
            **self.io.stamp(),
            request=request_fields(request),
            type=name,
            task_id=task_id,
            sender=user,
            store_id=entry.store_id,
            payload_on=self.io.switch.is_on(),
            payload_connected=self.link.payload_rid is not None,
            queued=len(self.io.store),
            **extra,
        )
        _log.info(
            "bus_command_received",
            type=name,
            seq=request.seq,
            source=request.source_id,
            task_id=task_id,
            store_id=entry.store_id,
            queued=len(self.io.store),
        )

    @staticmethod
    def _header_request(packet: bytes) -> RequestRef | None:
        try:
            return decode_header(packet).request
        except WireError as exc:
            return exc.request

    # ---- the store on the bus's own disk ----------------------------------------------------------
    def flush_store(self, now: float, force: bool = False) -> None:
        """Write the forwarding marks and confirmations waiting in memory. When the disk refuses,
        they stay in memory (and relaying goes on) and are tried again every STORAGE_RETRY_S."""
        if not self.io.store.has_pending:
            return
        if not force and _STORE_WRITER in self.storage.failing and now < self._store_retry_at:
            return
        try:
            self.io.store.flush()
        except OSError as exc:
            self._store_retry_at = now + STORAGE_RETRY_S
            self.storage.failed(_STORE_WRITER, exc)
        else:
            self.storage.succeeded(_STORE_WRITER)

    def retry_storage(self, now: float) -> None:
        """While some writer fails: the run log's held lines, and a store that has nothing to
        write (its failure was a refused command) is declared writable again by a probe. (The
        telemetry numbering tries its reservation again by itself, at its next packet.)"""
        if self.storage.ok or now < self._log_retry_at:
            return
        self._log_retry_at = now + STORAGE_RETRY_S
        if self.io.buslog.failing is not None:
            self.io.buslog.retry()
        if _STORE_WRITER in self.storage.failing and not self.io.store.has_pending:
            try:
                self.io.store.probe()
            except OSError:
                pass
            else:
                self.storage.succeeded(_STORE_WRITER)

    def _on_bus_command(self, received: Received, header: PacketHeader, message: m.Message) -> None:
        """A telecommand for the bus itself (APID BUS; its source id already checked against the
        sender's key): PAYLOAD_RETRY, from an admin station, ends the boot-loop guard's hold
        (docs/bus.md §6). Answered here, by the bus: ACCEPTED and COMPLETED, or REJECTED (NOT_HELD
        when nothing is held)."""
        request = header.request
        name = message.TYPE.name
        refusal = None
        if message.TYPE != MessageType.PAYLOAD_RETRY:
            refusal = WireError(
                ResponseCode.WRONG_APID,
                f"APID {header.apid:#05x} (the bus) takes only PAYLOAD_RETRY; {name} goes to the payload "
                f"({int(Apid.PAYLOAD):#05x})",
            )
        elif header.apid != Apid.BUS:
            refusal = WireError(
                ResponseCode.WRONG_APID, f"PAYLOAD_RETRY is the bus's: address it to APID {int(Apid.BUS):#05x}"
            )
        elif not is_admin_source(header.source_id):
            refusal = WireError(
                ResponseCode.NOT_AUTHORIZED,
                f"source id {header.source_id:#06x} is not an admin station's (0x0001-0x000f): "
                "only the operations centre powers the payload again",
            )
        elif not self.power.held_off:
            refusal = WireError(ResponseCode.NOT_HELD, "the payload is not held off by the boot-loop guard")
        if refusal is not None:
            self._reject_ground(received, refusal, request, None, name)
            return
        self._answer_ground(received, m.Accepted.about(request))
        self.power.retry_payload("ground", sender=received.user_id, request=request_fields(request))
        self._answer_ground(received, m.Completed.about(request))

    def _answer_ground(self, received: Received, report: m.Message) -> None:
        """A report from the bus itself: to the station that sent the command, and on the PUB."""
        packet = self.io.bus_packet(report)
        self.io.publish(packet)
        try:
            send_packet(self.io.commands_sock, packet, routing_id=received.routing_id, timeout_s=0.1)
        except LinkError:
            pass  # the PUB carries it too

    def forward(self) -> None:
        """Send live commands to the current payload connection: round-robin between the
        stations' queues (each station's in arrival order), at most max_in_flight unconfirmed
        in all, and no station more than its share of them while another waits; each is marked
        (durably, when the disk lets it) before it is sent."""
        if self.link.payload_rid is None or not self.io.switch.is_on() or not len(self.io.store):
            return
        queues: dict[str, list[StoredCommand]] = {}
        in_flight: Counter = Counter()
        for entry in self.io.store.pending():
            if entry.sent_link == self.link.link_id:
                in_flight[entry.sender] += 1
            else:
                queues.setdefault(entry.sender, []).append(entry)
        room = self.config.max_in_flight - sum(in_flight.values())
        if room <= 0 or not queues:
            return
        share = max(1, self.config.max_in_flight // len(set(queues) | set(in_flight)))
        order = sorted(queues)
        if self._served_last is not None:  # start with the station after the one served last
            later = [s for s in order if s > self._served_last]
            order = later + [s for s in order if s <= self._served_last]
        batch: list[StoredCommand] = []
        # The window's last slot is kept for a station that has nothing in flight, whose command
        # then goes at once instead of waiting for another station's whole window to be
        # confirmed (a probe's PING waited 5.27 s behind 32 flood PINGs on a loaded machine).
        spare = 1 if self.config.max_in_flight > 1 else 0
        for capped in (True, False):  # first within each station's share, then any room left
            progress = True
            while progress and len(batch) < room:
                progress = False
                for sender in order:
                    queue = queues[sender]
                    busy = in_flight[sender] > 0  # only a station with nothing in flight takes the spare
                    if (
                        not queue
                        or len(batch) >= room
                        or (busy and len(batch) >= room - spare)
                        or (capped and in_flight[sender] >= share)
                    ):
                        continue
                    batch.append(queue.pop(0))
                    in_flight[sender] += 1
                    self._served_last = sender
                    progress = True
        if not batch:
            return
        self.link.payload_queue_depth = None  # a command may add work: wait for the next housekeeping report
        for entry in batch:
            self.io.store.mark_forwarded(entry, self.link.link_id)
        # Durable marks tell a restarted bus that a resend is a redelivery. A disk that refuses
        # them does not stop the relay: they wait in memory (docs/bus.md "The bus's own disk").
        self.flush_store(time.monotonic())
        self.exchanges.exchanged(time.monotonic())
        for entry in batch:
            if not self.io.to_payload(entry.packet):
                return
            entry.sent_link, entry.sent_at = self.link.link_id, time.monotonic()
            self.routing.arm(entry.key)
            self.io.buslog.write(
                bl.COMMAND_FORWARDED,
                **self.io.stamp(),
                store_id=entry.store_id,
                type=entry.type_name,
                request=request_fields(entry.request),
                task_id=entry.task_id,
                link=self.link.link_id,
                redelivery=entry.forwards > 1,
            )

    def on_payload_packet(self, received: Received) -> None:
        now = time.monotonic()
        stations = self.stations
        if received.user_id == self.config.payload_client and not stations.key_current(received.user_id, received.key):
            self.stations.log_rejection(received.user_id, "NOT_AUTHORIZED", now)
            self.stations.close_revoked("payload", received.routing_id, received)
            if received.routing_id == self.link.payload_rid:
                self.link.payload_rid = None
            return
        if received.user_id != self.config.payload_client:
            self.io.buslog.write(bl.LINK_REFUSED, **self.io.stamp(now), link="payload", client=received.user_id)
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
                packet = self.io.bus_packet(report)
                send_packet(self.io.payload_sock, packet, routing_id=received.routing_id, timeout_s=0.1)
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
        self.stations.note_connection("payload", received.routing_id, received)
        if self.io.switch.is_on() and received.routing_id != self.link.payload_rid:
            self._payload_connected(received.routing_id, message, now)
        if self.on_payload_message is not None:
            self.on_payload_message(message, now)
        if received.routing_id == self.link.payload_rid:
            if self.link.last_seen is not None and now - self.link.last_seen > self.config.heartbeat_gap_log_s:
                self.io.buslog.write(
                    bl.HEARTBEAT_GAP,
                    **self.io.stamp(now),
                    gap_s=round(now - self.link.last_seen, 3),
                    action="none",
                    phase="running",
                )
                if self.fdir.mode is FdirMode.DEGRADED:
                    self.fdir.mode = FdirMode.NOMINAL
            self.link.last_seen = now
            self.link.gap_reported = False
            if isinstance(message, m.Housekeeping):
                self.link.payload_queue_depth = message.queue_depth
            if isinstance(message, m.Progress) and not self.power.boot_up:
                self.power.boot_came_up()  # it did a unit of work: this boot came up, however soon it ends
            if isinstance(message, m.Heartbeat):
                self._confirm_by_time(now)
                if message.current_task is None:
                    self.link.payload_idle_since = self.link.payload_idle_since or now
                else:
                    self.link.payload_idle_since = None
        # A redelivery's REJECTED REPLAYED_SEQUENCE (the payload ran the command before a cut took
        # its reports) is the bus's own business: not routed, and not published either, or a
        # ground listening on the telemetry link takes it for a refusal of its command.
        if not self.routing.route_payload_report(message, received.packet, now):
            self.io.publish(received.packet)

    def _payload_connected(self, rid: bytes | None, message: m.Message, now: float) -> None:
        if self.config.hold_for_connect:
            self.clock.release(now)  # the window's trace time starts now
        self.power.boot_connected(now)
        # What the ground sent to an earlier connection and heard nothing about may have gone with
        # it: those stations hold skip-idle until they hear from the payload again.
        self.exchanges.answers_lost(self.routing.owed_answers(now), now)
        self.link.link_id += 1
        self.link.payload_rid = rid
        self.link.last_seen = now
        self.link.payload_idle_since = None
        self.link.payload_queue_depth = None  # unknown until its next housekeeping report
        boot_count = message.boot_count if isinstance(message, m.Heartbeat) else None
        self.io.buslog.write(
            bl.PAYLOAD_CONNECTED,
            **self.io.stamp(now),
            link=self.link.link_id,
            boot_count=boot_count,
            after_power_on_s=round(now - self.power.powered_at, 3) if self.power.powered_at else None,
            queued=len(self.io.store),
        )
        _log.info("bus_payload_connected", link=self.link.link_id, boot_count=boot_count, queued=len(self.io.store))
        self.io.to_payload(
            self.io.bus_packet(
                m.PowerStateChange(
                    trace_time_s=self.clock.clock_s(now),
                    payload_on=True,
                    cause=PowerCause.RESTORED,
                    after_fault=self.power.last_off_fault,
                )
            )
        )
        if self.timeline.pending_warning is not None:
            self.timeline.warn(redelivered=True)

    def _confirm_by_time(self, now: float) -> None:
        """Telecommands that asked for no acceptance report cannot be confirmed by one: once the
        payload has lived `confirm_after_s` after receiving one, it counts as delivered."""
        for entry in self.io.store.pending():
            if (
                entry.sent_link == self.link.link_id
                and entry.sent_at is not None
                and now - entry.sent_at >= self.config.confirm_after_s
                and not entry.wants_acceptance
            ):
                self.routing.confirm_stored(entry, "assumed", now)
