"""What every part of the bus shares: its configuration, trace and clock, the resources `start()`
opens, the state of the payload link, and the primitives all parts use (a run-log stamp, a packet
from the bus, a telemetry publish, a packet to the payload).

The bus is built up in layers, one concern each (docs/bus.md "Where things are"):
`BusBase` -> `TelemetryPart` -> `PowerPart` -> `TimelinePart` -> `RoutingPart` -> `RelayPart` -> `Bus`.
Each part sets its own state in its `__init__` and may call the parts below it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Protocol

import zmq

import traces
from common import log
from common.wire import Apid, EventId, MessageType, NodeId, encode
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.ids import MAX_EVENT_TEXT_BYTES
from common.wire.link import Endpoints, KeyLayout, LinkError, send_packet
from common.wire.text import clip_utf8
from hil.bus import buslog as bl
from hil.bus.busstore import CommandStore
from hil.bus.clock import TraceClock
from hil.bus.config import BusConfig, BusConfigError
from hil.bus.power import PowerSwitch
from hil.bus.storage import StorageWatch, TolerantSequenceCounter

_log = log.get("hil.bus")


class Pacer(Protocol):
    """Replays only (hil/replay.py, hil/redteam.py): `step` runs every loop and may hold the
    clock; `payload_message` sees every packet from the payload."""

    def step(self, bus: Any, now: float) -> None: ...

    def payload_message(self, bus: Any, message: m.Message, now: float) -> None: ...


def request_fields(request: RequestRef) -> dict:
    """A request id as the run log writes it."""
    try:
        type_name = MessageType(request.message_type).name
    except ValueError:
        type_name = f"{request.message_type:#06x}"
    return {"apid": request.apid, "source": request.source_id, "seq": request.seq, "type": type_name}


class BusBase:
    """Configuration, trace, clock and payload-link state; the packet primitives."""

    # Opened by Bus.start(), once the data directory is locked (hil/bus/lifecycle.py).
    store: CommandStore
    tm_counter: TolerantSequenceCounter
    buslog: bl.BusLog
    switch: PowerSwitch
    commands_sock: zmq.Socket
    payload_sock: zmq.Socket
    telemetry_sock: zmq.Socket

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer: Pacer | None = None):
        config.validate()
        if config.hold_for_connect and pacer is not None:
            raise BusConfigError("hold_for_connect and a pacer would both hold the trace clock; use one")
        self.config = config
        self.pacer = pacer
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.layout = KeyLayout(Path(config.keys_dir))
        if not self.layout.server_secret.exists():
            raise BusConfigError(f"no bus key pair in {self.layout.server_dir} (run `ow ground keys init`)")
        try:
            self.trace = traces.load(config.trace)
        except (ValueError, OSError) as exc:  # TraceError is a ValueError
            raise BusConfigError(f"trace {config.trace}: {exc}") from None
        if config.start_at_s > self.trace.duration_s:
            raise BusConfigError(f"--start-at {config.start_at_s} is after the trace's end ({self.trace.duration_s} s)")
        self._switch_override = switch
        self.endpoints: Endpoints | None = None
        self.payload_connect_endpoint: str | None = None
        self._stop = threading.Event()
        self.stop_reason = "requested"
        #: trace time; its t0 is set when the run log opens, and again when the run starts
        self.clock = TraceClock(config.time_scale, config.start_at_s)
        #: the trace has run out (the timeline sets it; telemetry then repeats the last sample)
        self.trace_ended = False
        # The payload link: which connection is the payload's (a new one after each boot), when it
        # was last heard, and what it last said about its work (for skip-idle).
        self.link_id = 0
        self.payload_rid: bytes | None = None
        self.last_seen: float | None = None
        self.gap_reported = False
        self.payload_idle_since: float | None = None
        self.payload_queue_depth: int | None = None
        #: the bus's own disk: which writers fail (docs/bus.md "The bus's own disk")
        self.storage = StorageWatch(self._storage_changed)
        #: bus events raised before the telemetry socket was bound (published once it is)
        self._early_events: list[tuple[EventId, str, dict]] = []

    def request_stop(self, reason: str = "requested") -> None:
        self.stop_reason = reason
        self._stop.set()

    def _stamp(self, now: float | None = None) -> dict[str, float]:
        """The times every run-log record carries."""
        now = time.monotonic() if now is None else now
        return {"trace_s": self.clock.trace_s(now), "clock_s": self.clock.clock_s(now), "wall_s": now - self.clock.t0}

    def _bus_packet(self, message: m.Message) -> bytes:
        return encode(message, Apid.BUS, self.tm_counter.next(Apid.BUS), source_id=NodeId.BUS)

    def _bus_event(self, event_id: EventId, text: str, **fields: Any) -> None:
        """An event from the bus itself (APID BUS, source BUS): published on the telemetry link
        (`ow ground events` shows it) and written to the run log."""
        text = clip_utf8(text, MAX_EVENT_TEXT_BYTES)
        if getattr(self, "telemetry_sock", None) is None or getattr(self, "buslog", None) is None:
            self._early_events.append((event_id, text, fields))
            return
        self._publish(self._bus_packet(m.Event(event_id=event_id, text=text)))
        self.buslog.write(bl.BUS_EVENT, **self._stamp(), event=event_id.name, text=text, **fields)
        _log.warning("bus_event", bus_event=event_id.name, text=text, **fields)

    def _publish_early_events(self) -> None:
        early, self._early_events = self._early_events, []
        for event_id, text, fields in early:
            self._bus_event(event_id, text, **fields)

    def _storage_changed(self, failing: bool, detail: str) -> None:
        if failing:
            condition = self.storage.condition or "error"
            self._bus_event(
                EventId.BUS_STORAGE_FULL,
                f"bus storage {condition} ({detail}): what the bus cannot store is refused (BUS_STORAGE_FULL) "
                "or held in memory until the disk takes writes again; stored commands are still relayed",
                condition=condition,
            )
        else:
            self._bus_event(EventId.BUS_STORAGE_RESTORED, f"bus storage writable again {detail}")

    def _publish(self, packet: bytes) -> None:
        try:
            send_packet(self.telemetry_sock, packet, timeout_s=0.05)
        except LinkError as exc:  # a PUB socket drops rather than blocks; this is not expected
            _log.warning("bus_publish_failed", error=str(exc))

    def _to_payload(self, packet: bytes) -> bool:
        if self.payload_rid is None:
            return False
        try:
            send_packet(self.payload_sock, packet, routing_id=self.payload_rid, timeout_s=0.2)
            return True
        except LinkError as exc:
            _log.info("bus_payload_link_lost", error=str(exc))
            self.payload_rid = None
            return False
