"""Helpers of the bus tests: hand-written traces, a ground station client, the scripted test
payload (tests/bus/scripted_payload.py) and bus configurations on ephemeral loopback ports."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

import traces
from common.wire import AckFlags, Apid, NodeId, SequenceCounter, WireError, decode, encode
from common.wire import messages as m
from common.wire.link import Endpoints, KeyLayout, client_socket, recv_packet, send_packet
from hil.bus import BusConfig
from traces import CutCause, PowerWindow, TelemetrySample

HERE = Path(__file__).resolve().parent
SCRIPTED_PAYLOAD = HERE / "scripted_payload.py"
#: How long a wait for a condition may last before the test calls it a hang. Waits end when their
#: condition holds; the deadline only turns a hang into a failure that says what was awaited, and a
#: stalled 2-core machine may take many times the usual seconds.
HANG_S = 300.0
LOOPBACK = Endpoints(commands="tcp://127.0.0.1:*", payload="tcp://127.0.0.1:*", telemetry="tcp://127.0.0.1:*")


def write_trace(path: Path, duration_s: float, windows: list[PowerWindow], *, telemetry: bool = True) -> Path:
    """A valid trace file with these windows and (optionally) a 1 Hz telemetry sample every second."""
    samples: tuple[TelemetrySample, ...] = ()
    if telemetry:
        samples = tuple(
            TelemetrySample(
                float(t),
                16.0 + t / 1000,
                0.9,
                40.0 + t % 100,
                15.0 if any(w.start_s <= t < w.end_s for w in windows) else 0.0,
            )
            for t in range(int(duration_s) + 1)
        )
    trace = traces.Trace.from_windows(
        path.stem,
        duration_s,
        windows,
        telemetry=samples,
        telemetry_period_s=1.0 if telemetry else None,
        description="bus test trace",
    )
    return traces.dump(trace, path)


def window(start: float, end: float, cause: CutCause | None = CutCause.THERMAL, lead: float = 0.0) -> PowerWindow:
    return PowerWindow(start, end, cause, lead)


def scripted_payload_command(record: Path, *extra: str) -> list[str]:
    """Payload command template for the bus: the scripted test payload writing to `record`."""
    return [
        sys.executable,
        str(SCRIPTED_PAYLOAD),
        "--keys",
        "{keys}",
        "--endpoint",
        "{payload_endpoint}",
        "--record",
        str(record),
        *extra,
    ]


def bus_config(
    tmp_path: Path, keys: KeyLayout, trace: Path, record: Path, *, payload_args: tuple = (), **overrides
) -> BusConfig:
    settings: dict[str, Any] = dict(
        trace=str(trace),
        data_dir=tmp_path / "bus",
        keys_dir=keys.root,
        time_scale=0.1,
        endpoints=LOOPBACK,
        payload_command=scripted_payload_command(record, *payload_args),
        # FDIR's deadlines on a payload that is merely slow (a stalled machine) are hang guards
        # here; the tests of FDIR itself set their own
        heartbeat_timeout_s=60.0,
        boot_timeout_s=HANG_S,
        heartbeat_gap_log_s=1.0,
    )
    settings.update(overrides)
    return BusConfig(**settings)


def read_record(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line a SIGKILL tore
    return out


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@dataclass
class GroundStation:
    """A ground station's command link: a CURVE DEALER with its own key and sequence counter."""

    sock: zmq.Socket
    source_id: int = NodeId.GROUND
    counter: SequenceCounter = field(default_factory=SequenceCounter)
    inbox: list = field(default_factory=list)

    def send(self, message: m.Message, ack: AckFlags = AckFlags.ALL) -> tuple[bytes, int]:
        seq = self.counter.next(Apid.PAYLOAD)
        packet = encode(message, Apid.PAYLOAD, seq, source_id=self.source_id, ack_flags=ack)
        send_packet(self.sock, packet, timeout_s=2)
        return packet, seq

    def send_raw(self, packet: bytes) -> None:
        send_packet(self.sock, packet, timeout_s=2)

    def collect(self, duration_s: float) -> list[tuple]:
        """Every (header, message) that arrives within `duration_s`, added to `inbox`."""
        deadline = time.monotonic() + duration_s
        got: list[tuple] = []
        while (remaining := deadline - time.monotonic()) > 0:
            received = recv_packet(self.sock, timeout_s=min(remaining, 0.1))
            if received is not None:
                try:
                    got.append(decode(received.packet))
                except WireError as exc:
                    got.append((None, exc))
        self.inbox.extend(got)
        return got

    def wait(self, predicate, timeout_s: float) -> list[tuple]:
        """Collect until predicate(inbox) is true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate(self.inbox):
                return self.inbox
            self.collect(0.1)
        raise AssertionError(f"ground inbox after {timeout_s} s: {[type(x[1]).__name__ for x in self.inbox]}")


def ground_station(
    context,
    keys: KeyLayout,
    endpoint: str,
    name: str = "ground",
    source_id: int = NodeId.GROUND,
    layout: KeyLayout | None = None,
) -> GroundStation:
    sock = client_socket(context, zmq.DEALER, layout or keys, name, endpoint, handshake_timeout_s=HANG_S)
    return GroundStation(sock=sock, source_id=source_id)


def telemetry_subscriber(context, keys: KeyLayout, endpoint: str) -> zmq.Socket:
    return client_socket(context, zmq.SUB, keys, "ground", endpoint, handshake_timeout_s=HANG_S)


def drain(sock: zmq.Socket, duration_s: float) -> list[tuple]:
    deadline = time.monotonic() + duration_s
    out = []
    while (remaining := deadline - time.monotonic()) > 0:
        received = recv_packet(sock, timeout_s=min(remaining, 0.1))
        if received is not None:
            out.append(decode(received.packet))
    return out


def drain_until(sock: zmq.Socket, reached, what: str, deadline_s: float = HANG_S) -> list[tuple]:
    """Packets until `reached(packets)` holds. The deadline is only there so that a bus that never
    gets there fails with what was awaited; a loaded machine only makes the wait longer."""
    deadline = time.monotonic() + deadline_s
    out: list[tuple] = []
    while not reached(out):
        assert time.monotonic() < deadline, f"waited {deadline_s:.0f} s for {what}; got {len(out)} packets"
        received = recv_packet(sock, timeout_s=0.1)
        if received is not None:
            out.append(decode(received.packet))
    return out
