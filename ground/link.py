"""The ground's two sockets to the bus, merged into one stream of decoded telemetry packets.

The DEALER (commands link) carries our telecommands up and, when the bus can route them, the
payload's answers back; the SUB (telemetry link) carries everything the payload and the bus
publish, including those same answers. Either path alone must suffice (the bus may have
restarted and lost our routing id, or a subscription may still be propagating), so packets
from both are decoded, and the second copy of a packet is dropped by its content digest.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import zmq

from common import log
from common.wire import Apid, NodeId, PacketHeader, WireError, decode, encode
from common.wire import messages as m
from common.wire.ids import AckFlags
from common.wire.link import (
    Endpoints,
    KeyLayout,
    LinkAuthError,
    LinkError,
    LinkTimeout,
    client_socket,
    recv_packet,
    send_packet,
)
from common.wire.packet import PacketType
from ground.errors import LinkRefused, LocalInputError, NoAnswer

_log = log.get("ground.link")
#: How many recent packet digests are remembered to drop the second copy.
DEDUP_MEMORY = 8192


@dataclass(frozen=True)
class Telemetry:
    """One decoded packet as received."""

    header: PacketHeader
    message: m.Message
    digest: str
    #: "commands" (DEALER) or "telemetry" (SUB)
    via: str
    received_at: float


def check_keys(layout: KeyLayout, station: str) -> None:
    """Refuse early, and clearly, when the keys directory lacks what a ground station needs."""
    missing = [p for p in (layout.client_secret(station), layout.server_public) if not p.exists()]
    if missing:
        listed = ", ".join(str(p) for p in missing)
        raise LocalInputError(
            f"missing key file(s) {listed}; create them with `ow ground keys init --keys {layout.root}`"
        )


#: The CURVE handshake's own deadline, apart from the client's answer timeout: a short "no answer"
#: wait (a second, to see that a silent payload stays silent) must not also fail the connection to
#: a bus that is merely slow to accept it on a loaded machine.
DEFAULT_HANDSHAKE_TIMEOUT_S = 30.0


class GroundLink:
    """Connected DEALER + SUB with CURVE, or either alone."""

    def __init__(
        self,
        keys_dir: str | Path,
        *,
        station: str = "ground",
        endpoints: Endpoints | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        commands: bool = True,
        telemetry: bool = True,
        context: zmq.Context | None = None,
    ):
        self.layout = KeyLayout(Path(keys_dir))
        self.station = station
        self.endpoints = endpoints or Endpoints.from_env()
        self.handshake_timeout_s = handshake_timeout_s
        self._want_commands = commands
        self._want_telemetry = telemetry
        self._own_context = context is None
        self.context = context or zmq.Context()
        self.dealer: zmq.Socket | None = None
        self.sub: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.undecodable = 0

    # --- connection ---------------------------------------------------------------------------
    def open(self) -> GroundLink:
        """Connect (idempotent). On failure everything opened so far is closed again."""
        if self.dealer is not None or self.sub is not None:
            return self
        check_keys(self.layout, self.station)
        if self._own_context and self.context.closed:
            self.context = zmq.Context()  # opened again after a close
        try:
            if self._want_telemetry:
                # Subscribe first: answers to our first command may come only this way.
                self.sub = self._connect(zmq.SUB, self.endpoints.telemetry, "telemetry")
                self._poller.register(self.sub, zmq.POLLIN)
            if self._want_commands:
                self.dealer = self._connect(zmq.DEALER, self.endpoints.commands, "commands")
                self._poller.register(self.dealer, zmq.POLLIN)
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self, socket_type: int, endpoint: str, what: str) -> zmq.Socket:
        try:
            return client_socket(
                self.context,
                socket_type,
                self.layout,
                self.station,
                endpoint,
                handshake_timeout_s=self.handshake_timeout_s,
            )
        except LinkAuthError as exc:
            if "refused" in str(exc):
                raise LinkRefused(
                    f"the bus refused station {self.station!r} on the {what} link at {endpoint}: its public key "
                    f"{self.layout.client_public(self.station)} is not in the bus's authorized/ directory"
                ) from None
            raise LinkRefused(
                f"CURVE handshake with the bus at {endpoint} ({what} link) failed for station {self.station!r}: "
                f"{self.layout.server_public} is not the public key of this bus ({exc})"
            ) from None
        except LinkTimeout:
            raise NoAnswer(
                f"no CURVE handshake with the bus at {endpoint} ({what} link) within {self.handshake_timeout_s:g} s: "
                f"the bus is not running or not reachable there, or {self.layout.server_public} is not its public key"
            ) from None
        except (OSError, ValueError, zmq.ZMQError, LinkError) as exc:
            raise LocalInputError(f"cannot open the {what} link to {endpoint}: {exc}") from None

    def close(self) -> None:
        for sock in (self.dealer, self.sub):
            if sock is not None:
                self._poller.unregister(sock)
                sock.close()
        self.dealer = self.sub = None
        if self._own_context and not self.context.closed:
            self.context.term()

    def __enter__(self) -> GroundLink:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- traffic ------------------------------------------------------------------------------
    def send(
        self,
        message: m.Message,
        seq: int,
        *,
        source_id: int = NodeId.GROUND,
        timeout_s: float = 5.0,
        ack_flags: AckFlags = AckFlags.ALL,
        apid: Apid = Apid.PAYLOAD,
    ) -> None:
        """Send one telecommand, to the payload APID unless told otherwise (the bus's own command
        goes to APID BUS). Raises NoAnswer if the DEALER cannot take it (no connection to the bus
        and its queue is full)."""
        if self.dealer is None:
            raise RuntimeError("commands link not open")
        packet = encode(message, apid, seq, source_id=source_id, ack_flags=ack_flags)
        try:
            send_packet(self.dealer, packet, timeout_s=timeout_s)
        except LinkError as exc:
            raise NoAnswer(f"cannot hand {message.TYPE.name} to the bus at {self.endpoints.commands}: {exc}") from None

    def receive(self, timeout_s: float) -> list[Telemetry]:
        """Packets that arrive within `timeout_s` (returns as soon as at least one did), first
        copies only. Undecodable packets and stray telecommands are logged and skipped."""
        ready = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        out: list[Telemetry] = []
        for sock, via in ((self.dealer, "commands"), (self.sub, "telemetry")):
            if sock is None or sock not in ready:
                continue
            # Drain what is queued now, so one slow path cannot starve the other.
            for _ in range(256):
                received = recv_packet(sock, timeout_s=0)
                if received is None:
                    break
                packet = self._decode(received.packet, via)
                if packet is not None:
                    out.append(packet)
        return out

    def _decode(self, data: bytes, via: str) -> Telemetry | None:
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        if digest in self._seen:
            return None
        self._seen[digest] = None
        if len(self._seen) > DEDUP_MEMORY:
            self._seen.popitem(last=False)
        try:
            header, message = decode(data)
        except WireError as exc:
            self.undecodable += 1
            _log.warning("ground_packet_undecodable", via=via, code=exc.code.name, reason=exc.reason)
            return None
        if header.packet_type != PacketType.TM:
            _log.warning("ground_packet_unexpected", via=via, type=message.TYPE.name)
            return None
        return Telemetry(header=header, message=message, digest=digest, via=via, received_at=time.time())
