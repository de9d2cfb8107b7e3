"""What the parts of the bus share, each as one object that `Bus` (hil/bus/lifecycle.py) owns and
hands to the parts that use it (docs/bus.md "Where things are"):

    PayloadLink    the payload link: which connection is the payload's, when it was last heard,
                   what it last said about its work (the relay writes it; power, the timeline
                   and the packet primitives read it)
    FdirChannels   FDIR's telemetry channels: mode, fault count, last fault (power and FDIR set
                   them, the relay clears a degraded link, telemetry reports them)
    GroundExchanges  what skip-idle must know of the ground: when the relay last carried a ground
                   command or a payload's answer, and which stations a cut left waiting for an
                   answer (the relay and routing write it, the timeline reads it)
    StopRequest    the bus's stop: asked from any thread, read by the main loop and the power part
    BusIO          what `Bus.start()` opens -- the command store, the telemetry numbering, the
                   three sockets and their authenticator, the run log, the power switch -- and the
                   primitives every part writes through: run-log stamp, bus packet, publish, send
                   to the payload, bus event

Every attribute exists from `__init__` on. What `start()` opens is None in `BusIO` until then, and
read through properties that say so (`NotStarted`) instead of failing on a missing attribute.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import zmq

from common import log
from common.wire import Apid, EventId, FdirMode, MessageType, NodeId, encode
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.ids import MAX_EVENT_TEXT_BYTES
from common.wire.link import (
    AuthorizedKeys,
    CurveAuthenticator,
    Endpoints,
    KeyLayout,
    LinkError,
    bound_endpoint,
    send_packet,
    server_socket,
    start_authenticator,
)
from common.wire.text import clip_utf8
from hil.bus import buslog as bl
from hil.bus.busstore import CommandStore
from hil.bus.clock import TraceClock
from hil.bus.power import PowerSwitch
from hil.bus.storage import TolerantSequenceCounter

_log = log.get("hil.bus")

_Opened = TypeVar("_Opened")


class Pacer(Protocol):
    """Replays only (hil/replay.py, hil/redteam.py): `step` runs every loop and may hold the
    clock; `payload_message` sees every packet from the payload. `bus` is the `Bus`."""

    def step(self, bus: Any, now: float) -> None: ...

    def payload_message(self, bus: Any, message: m.Message, now: float) -> None: ...


def request_fields(request: RequestRef) -> dict:
    """A request id as the run log writes it."""
    try:
        type_name = MessageType(request.message_type).name
    except ValueError:
        type_name = f"{request.message_type:#06x}"
    return {"apid": request.apid, "source": request.source_id, "seq": request.seq, "type": type_name}


@dataclass
class PayloadLink:
    """The payload link: the payload's connection (a new one after each boot, counted by
    `link_id`), when it was last heard, and what it last said about its work (for skip-idle)."""

    link_id: int = 0
    payload_rid: bytes | None = None
    last_seen: float | None = None
    gap_reported: bool = False
    payload_idle_since: float | None = None
    payload_queue_depth: int | None = None


#: A request as the store and routing key it: (apid, source id, seq, message type).
RequestKey = tuple[int, int, int, int]


@dataclass
class StationWait:
    """A ground station that a cut (or a lost payload connection) left waiting for an answer."""

    name: str | None
    #: when the bus found it waiting (monotonic)
    since: float
    #: its requests whose answers may have gone with the cut, not answered since
    owed: set[RequestKey] = field(default_factory=set)
    #: its requests received after that (the ground asking again): an answer to one of them
    #: means the station has heard from the payload again
    fresh: set[RequestKey] = field(default_factory=set)


@dataclass
class GroundExchanges:
    """What skip-idle must know of the ground (docs/bus.md §1 "Skipping idle spans"): the payload
    may be idle while a ground station is in the middle of an exchange with it -- between an
    answer and its next command, or waiting for an answer that a cut took (it will ask again only
    after its own time-out). The relay notes each ground command it takes and forwards; routing
    notes each answer of the payload and whom it reached."""

    #: when the relay last carried a ground command or a payload's answer (monotonic), or None
    last_exchange: float | None = None
    #: stations a cut left waiting, by source id
    waiting: dict[int, StationWait] = field(default_factory=dict)

    def exchanged(self, now: float) -> None:
        """A ground command or a payload's answer went through the relay at `now`."""
        if self.last_exchange is None or now > self.last_exchange:
            self.last_exchange = now

    def quiet_s(self, now: float) -> float:
        """Wall seconds since the last exchange (infinite before the first)."""
        return math.inf if self.last_exchange is None else now - self.last_exchange

    def answers_lost(self, owed: dict[int, tuple[str | None, set[RequestKey]]], now: float) -> None:
        """A new payload connection: these stations' requests went to an earlier one and were not
        answered; their answers may be lost (source id -> (key name, request keys))."""
        for source, (name, keys) in owed.items():
            wait = self.waiting.get(source)
            if wait is None:
                self.waiting[source] = StationWait(name, now, set(keys))
            else:
                wait.owed |= keys
                wait.name = wait.name or name

    def asked(self, key: RequestKey) -> None:
        """A station sent request `key` (its source is key[1]) to the bus."""
        wait = self.waiting.get(key[1])
        if wait is not None:
            wait.fresh.add(key)

    def answered(self, key: RequestKey) -> None:
        """A report of the payload about request `key` reached its station (key[1]). The station
        waits no longer once every answer it was owed has come, or once the payload has answered
        a request it sent since (it has asked again)."""
        wait = self.waiting.get(key[1])
        if wait is None:
            return
        wait.owed.discard(key)
        if not wait.owed or key in wait.fresh:
            del self.waiting[key[1]]


@dataclass
class FdirChannels:
    """FDIR's telemetry channels (FDIR_REPORT)."""

    mode: FdirMode = FdirMode.NOMINAL
    fault_count: int = 0
    last_fault: str | None = None


class StopRequest:
    """The bus's stop: `request` from any thread; the loop ends at its next round."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = "requested"

    def request(self, reason: str = "requested") -> None:
        self.reason = reason
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


class NotStarted(RuntimeError):
    """Something only a started bus has (its sockets, store, run log or switch) was used before
    `Bus.start()` opened it."""


def _opened(value: _Opened | None, what: str) -> _Opened:
    if value is None:
        raise NotStarted(f"the bus has no {what} before Bus.start()")
    return value


class BusIO:
    """The bus's resources, opened by `Bus.start()` in order (store and numbering, sockets, run
    log, switch), closed by `close()`; and the primitives every part writes through."""

    def __init__(self, clock: TraceClock, link: PayloadLink):
        self.clock = clock
        self.link = link
        self._store: CommandStore | None = None
        self._tm_counter: TolerantSequenceCounter | None = None
        self._ctx: zmq.Context | None = None
        self._auth: CurveAuthenticator | None = None
        self._commands_sock: zmq.Socket | None = None
        self._payload_sock: zmq.Socket | None = None
        self._telemetry_sock: zmq.Socket | None = None
        self._buslog: bl.BusLog | None = None
        self._switch: PowerSwitch | None = None
        #: bus events raised before the telemetry socket and the run log were open (published
        #: once they are: `publish_early_events`)
        self._early_events: list[tuple[EventId, str, dict]] = []

    # ---- opening and closing --------------------------------------------------------------------
    def open_store(self, store: CommandStore, tm_counter: TolerantSequenceCounter) -> None:
        self._store, self._tm_counter = store, tm_counter

    def bind(self, layout: KeyLayout, endpoints: Endpoints) -> Endpoints:
        """The three CURVE server sockets and their authenticator; the endpoints they bound."""
        self._ctx = zmq.Context()
        self._auth = start_authenticator(self._ctx, layout)
        self._commands_sock = server_socket(self._ctx, zmq.ROUTER, layout, endpoints.commands)
        self._payload_sock = server_socket(self._ctx, zmq.ROUTER, layout, endpoints.payload)
        # XPUB, not PUB: its subscription messages name each subscriber's key and connection,
        # so that a revoked key's telemetry subscription can be closed too.
        self._telemetry_sock = server_socket(self._ctx, zmq.XPUB, layout, endpoints.telemetry)
        self._telemetry_sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        return Endpoints(
            commands=bound_endpoint(self._commands_sock),
            payload=bound_endpoint(self._payload_sock),
            telemetry=bound_endpoint(self._telemetry_sock),
        )

    def open_log(self, buslog: bl.BusLog) -> None:
        self._buslog = buslog

    def attach_switch(self, switch: PowerSwitch) -> None:
        self._switch = switch

    def close(self) -> None:
        """The run log (if open), the sockets, the authenticator and the context."""
        if self._buslog is not None:
            self._buslog.close()
        for sock in (self._commands_sock, self._payload_sock, self._telemetry_sock):
            if sock is not None:
                sock.close(linger=200)
        self._commands_sock = self._payload_sock = self._telemetry_sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ---- what start() opened ----------------------------------------------------------------------
    @property
    def store(self) -> CommandStore:
        return _opened(self._store, "command store")

    @property
    def buslog(self) -> bl.BusLog:
        return _opened(self._buslog, "run log")

    @property
    def switch(self) -> PowerSwitch:
        return _opened(self._switch, "power switch")

    @property
    def commands_sock(self) -> zmq.Socket:
        return _opened(self._commands_sock, "commands socket")

    @property
    def payload_sock(self) -> zmq.Socket:
        return _opened(self._payload_sock, "payload socket")

    @property
    def telemetry_sock(self) -> zmq.Socket:
        return _opened(self._telemetry_sock, "telemetry socket")

    @property
    def keys(self) -> AuthorizedKeys:
        """The authorized keys, as the authenticator reads them."""
        return _opened(self._auth, "authenticator").keys

    @property
    def log_open(self) -> bool:
        return self._buslog is not None

    # ---- the primitives ---------------------------------------------------------------------------
    def stamp(self, now: float | None = None) -> dict[str, float]:
        """The times every run-log record carries."""
        now = time.monotonic() if now is None else now
        return {"trace_s": self.clock.trace_s(now), "clock_s": self.clock.clock_s(now), "wall_s": now - self.clock.t0}

    def bus_packet(self, message: m.Message) -> bytes:
        """`message` from the bus itself (APID BUS, source BUS), numbered."""
        counter = _opened(self._tm_counter, "telemetry numbering")
        return encode(message, Apid.BUS, counter.next(Apid.BUS), source_id=NodeId.BUS)

    def publish(self, packet: bytes) -> None:
        try:
            send_packet(self.telemetry_sock, packet, timeout_s=0.05)
        except LinkError as exc:  # a PUB socket drops rather than blocks; this is not expected
            _log.warning("bus_publish_failed", error=str(exc))

    def to_payload(self, packet: bytes) -> bool:
        """Send to the payload's current connection; False (and the link forgotten) if none."""
        link = self.link
        if link.payload_rid is None:
            return False
        try:
            send_packet(self.payload_sock, packet, routing_id=link.payload_rid, timeout_s=0.2)
            return True
        except LinkError as exc:
            _log.info("bus_payload_link_lost", error=str(exc))
            link.payload_rid = None
            return False

    def bus_event(self, event_id: EventId, text: str, **fields: Any) -> None:
        """An event from the bus itself (APID BUS, source BUS): published on the telemetry link
        (`ow ground events` shows it) and written to the run log; held until both are open."""
        text = clip_utf8(text, MAX_EVENT_TEXT_BYTES)
        if self._telemetry_sock is None or self._buslog is None:
            self._early_events.append((event_id, text, fields))
            return
        self.publish(self.bus_packet(m.Event(event_id=event_id, text=text)))
        self._buslog.write(bl.BUS_EVENT, **self.stamp(), event=event_id.name, text=text, **fields)
        _log.warning("bus_event", bus_event=event_id.name, text=text, **fields)

    def publish_early_events(self) -> None:
        early, self._early_events = self._early_events, []
        for event_id, text, fields in early:
            self.bus_event(event_id, text, **fields)
