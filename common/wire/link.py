"""ZeroMQ links with CurveZMQ authentication (docs/wire-protocol.md §7).

The bus is the CURVE server of every link: it binds a ROUTER for ground stations (commands),
a ROUTER for the payload, and a PUB for telemetry. Ground tools and the payload connect as
CURVE clients; the bus's authenticator admits only public keys found in the keys directory's
`authorized/` folder and names each connection after its key file (ZMQ "User-Id").

Each ZeroMQ message is exactly one packet (one frame; ROUTER sockets add the routing id frame),
so a subscriber can filter on the packet's first two bytes (version, type, APID).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from common import log
from common.wire.fields import check_name
from common.wire.ids import MAX_PACKET_BYTES

SERVER_NAME = "bus"
DEFAULT_CLIENTS = ("ground", "payload")
#: All OrbitWeaver server sockets use this ZAP domain.
ZAP_DOMAIN = "orbitweaver"
#: How long close() may keep trying to deliver queued packets.
LINGER_MS = 500
#: Largest ZeroMQ message a socket takes (ZMQ_MAXMSGSIZE): one packet plus headroom. A peer that
#: sends more is disconnected by libzmq before the message is buffered, so even an authorized
#: client cannot make a bus or payload allocate more than this per message.
MAX_MESSAGE_BYTES = MAX_PACKET_BYTES + 1024

_log = log.get("wire.link")


class LinkError(Exception):
    """A link could not carry a packet (peer unreachable, authentication refused, ...)."""


class LinkTimeout(LinkError, TimeoutError):
    pass


class LinkAuthError(LinkError):
    """The CURVE handshake failed: wrong server key, or our key is not authorized."""


@dataclass(frozen=True)
class Endpoints:
    """Where the bus listens. Defaults are loopback; each can be overridden by an environment
    variable (OW_COMMANDS_ENDPOINT, OW_PAYLOAD_ENDPOINT, OW_TELEMETRY_ENDPOINT) or a CLI flag."""

    commands: str = "tcp://127.0.0.1:5550"
    payload: str = "tcp://127.0.0.1:5551"
    telemetry: str = "tcp://127.0.0.1:5552"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Endpoints:
        default = cls()
        return cls(
            commands=environ.get("OW_COMMANDS_ENDPOINT", default.commands),
            payload=environ.get("OW_PAYLOAD_ENDPOINT", default.payload),
            telemetry=environ.get("OW_TELEMETRY_ENDPOINT", default.telemetry),
        )


@dataclass(frozen=True)
class KeyLayout:
    """Files under a keys directory:

        server/bus.key, server/bus.key_secret          the bus's CURVE server key pair
        clients/<name>.key, clients/<name>.key_secret  one pair per client (ground, payload, ...)
        authorized/<name>.key                          public keys the bus admits
        state/                                         the ground's durable sequence counter

    A deployed ground station keeps only its own client pair, server/bus.key and state/; the
    bus keeps server/ and authorized/; the payload keeps its client pair and server/bus.key.
    """

    root: Path

    @property
    def server_dir(self) -> Path:
        return self.root / "server"

    @property
    def clients_dir(self) -> Path:
        return self.root / "clients"

    @property
    def authorized_dir(self) -> Path:
        return self.root / "authorized"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def server_public(self) -> Path:
        return self.server_dir / f"{SERVER_NAME}.key"

    @property
    def server_secret(self) -> Path:
        return self.server_dir / f"{SERVER_NAME}.key_secret"

    def client_public(self, name: str) -> Path:
        return self.clients_dir / f"{name}.key"

    def client_secret(self, name: str) -> Path:
        return self.clients_dir / f"{name}.key_secret"

    @property
    def ground_sequence_path(self) -> Path:
        """Where a ground tool keeps its DurableSequenceCounter."""
        return self.state_dir / "tc-sequence.bin"


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _create_pair(directory: Path, name: str) -> None:
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)


def init_keys(
    keys_dir: str | os.PathLike, clients: tuple[str, ...] = DEFAULT_CLIENTS, *, force: bool = False
) -> KeyLayout:
    """Create the server key pair and one pair per client, and authorize the clients.

    Existing key pairs are kept (running it twice changes nothing) unless `force`, which
    replaces every pair named here — clients then need the new server public key."""

    layout = KeyLayout(Path(keys_dir))
    for name in clients:
        check_name(name, "client name")
    for directory in (layout.root, layout.server_dir, layout.clients_dir, layout.authorized_dir, layout.state_dir):
        _private_dir(directory)
    if force or not (layout.server_public.exists() and layout.server_secret.exists()):
        _create_pair(layout.server_dir, SERVER_NAME)
        _log.info("link_key_created", role="server", name=SERVER_NAME, path=str(layout.server_public))
    for name in clients:
        if force or not (layout.client_public(name).exists() and layout.client_secret(name).exists()):
            _create_pair(layout.clients_dir, name)
            _log.info("link_key_created", role="client", name=name, path=str(layout.client_public(name)))
        authorize_client(layout, name, layout.client_public(name))
    return layout


def authorize_client(layout: KeyLayout, name: str, public_key_file: str | os.PathLike) -> Path:
    """Admit a client: copy its public key into authorized/<name>.key (takes effect for new
    connections without restarting the bus)."""
    public, secret = zmq.auth.load_certificate(public_key_file)
    if not public:
        raise ValueError(f"{public_key_file}: no CURVE public key")
    _private_dir(layout.authorized_dir)
    target = layout.authorized_dir / f"{name}.key"
    if Path(public_key_file).resolve() != target.resolve():
        shutil.copyfile(public_key_file, target)
    return target


class _AuthorizedKeys:
    """Credentials provider for pyzmq's authenticator: the public keys in one directory, reread
    whenever the directory changes, each named after its file."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._stamp: tuple | None = None
        self._names: dict[bytes, str] = {}

    def _refresh(self) -> None:
        try:
            entries = sorted(self.directory.glob("*.key"))
            stamp = tuple((p.name, p.stat().st_mtime_ns) for p in entries)
        except OSError:
            entries, stamp = [], ()
        if stamp == self._stamp:
            return
        names = {}
        for path in entries:
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError):
                _log.warning("link_key_unreadable", path=str(path))
                continue
            if public:
                names[public] = path.stem
        self._names, self._stamp = names, stamp

    def name_of(self, z85_key: bytes) -> str | None:
        self._refresh()
        return self._names.get(z85_key)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        name = self.name_of(z85_key)
        if name is None:
            _log.warning("link_auth_denied", domain=domain, client_key=z85_key.decode("ascii", "replace"))
            return False
        _log.info("link_auth_allowed", domain=domain, client=name)
        return True


class CurveAuthenticator(ThreadAuthenticator):
    """ZAP handler admitting only the public keys in `authorized_dir`; the authenticated
    client's name (key file stem) becomes the connection's User-Id."""

    def __init__(self, context: zmq.Context, authorized_dir: str | os.PathLike):
        super().__init__(context)
        self.keys = _AuthorizedKeys(Path(authorized_dir))

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self.keys)

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.keys.name_of(z85.encode(client_public_key)) or "unknown"


def start_authenticator(context: zmq.Context, layout: KeyLayout) -> CurveAuthenticator:
    """Start the authenticator for every CURVE server socket of `context`. Call .stop() at exit."""
    authenticator = CurveAuthenticator(context, layout.authorized_dir)
    authenticator.start()
    return authenticator


def _common_options(sock: zmq.Socket) -> None:
    sock.linger = LINGER_MS
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    # Detect a dead peer (a board whose power was cut: no FIN ever comes) within seconds, not at
    # the TCP timeout -- with the kernel's TCP keepalive, not ZMTP heartbeats: libzmq 4.3.5 aborts
    # (`_input_stopped`, stream_engine_base.cpp) or drops the connection when a heartbeat timer
    # fires while a flood has filled the receive queue, so a peer that outpaces a slow reader
    # (one fsync per command) could crash the bus or the payload (docs/wire-protocol.md §7).
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 2)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)


def server_socket(context: zmq.Context, socket_type: int, layout: KeyLayout, endpoint: str) -> zmq.Socket:
    """A bound CURVE server socket (ROUTER or PUB). Bind to tcp://127.0.0.1:* for a free port
    and read it back with `bound_endpoint`. ROUTER sockets refuse to send to an unknown peer
    (LinkError) rather than drop silently, so the bus knows when to store and forward."""
    public, secret = zmq.auth.load_certificate(layout.server_secret)
    sock = context.socket(socket_type)
    try:
        _common_options(sock)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def client_socket(
    context: zmq.Context,
    socket_type: int,
    layout: KeyLayout,
    client_name: str,
    endpoint: str,
    *,
    handshake_timeout_s: float | None = None,
    subscribe: bytes = b"",
) -> zmq.Socket:
    """A connected CURVE client socket (DEALER or SUB) using clients/<client_name>.key_secret.

    With `handshake_timeout_s`, wait for the CURVE handshake: raises LinkAuthError if the bus
    refuses the key (or ours does not match its server key), LinkTimeout if it does not answer.
    Without it, packets queue until the connection is up (the ground's store-and-forward)."""
    public, secret = zmq.auth.load_certificate(layout.client_secret(client_name))
    server_public, _ = zmq.auth.load_certificate(layout.server_public)
    if secret is None:
        raise LinkError(f"{layout.client_secret(client_name)}: no secret key")
    sock = context.socket(socket_type)
    try:
        _common_options(sock)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if socket_type == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, subscribe)
        monitor = sock.get_monitor_socket() if handshake_timeout_s is not None else None
        sock.connect(endpoint)
        if monitor is not None and handshake_timeout_s is not None:
            try:
                _await_handshake(monitor, endpoint, client_name, handshake_timeout_s)
            finally:
                sock.disable_monitor()
                monitor.close(linger=0)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


_AUTH_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key refused by the server",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (server key mismatch?)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}


def _await_handshake(monitor: zmq.Socket, endpoint: str, client_name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    disconnects = 0
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not monitor.poll(remaining_ms):
            # A server that cannot decrypt our HELLO (wrong server key) just drops the connection.
            detail = f" ({disconnects} connections dropped during handshake)" if disconnects else ""
            _log.warning("link_handshake_timeout", endpoint=endpoint, client=client_name, dropped=disconnects)
            raise LinkTimeout(f"{endpoint}: no CURVE handshake within {timeout_s:g} s{detail}")
        event = recv_monitor_message(monitor)
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            _log.info("link_connected", endpoint=endpoint, client=client_name)
            return
        if kind in _AUTH_FAILURES:
            _log.warning("link_auth_refused", endpoint=endpoint, client=client_name, detail=_AUTH_FAILURES[kind])
            raise LinkAuthError(f"{endpoint}: {_AUTH_FAILURES[kind]} for client {client_name!r}")
        if kind == zmq.EVENT_DISCONNECTED:
            disconnects += 1


def bound_endpoint(sock: zmq.Socket) -> str:
    """The endpoint a socket actually bound (resolves a '*' port)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


@dataclass(frozen=True)
class Received:
    packet: bytes
    #: ROUTER sockets: the sender's routing id, to address the reply.
    routing_id: bytes | None
    #: The authenticated client's name (its key file stem), where the socket is a CURVE server.
    user_id: str | None


def send_packet(sock: zmq.Socket, packet: bytes, *, routing_id: bytes | None = None, timeout_s: float = 5.0) -> None:
    """Send one packet; ROUTER sockets need `routing_id`. Raises LinkTimeout if the socket cannot
    take it within `timeout_s` (high-water mark reached, or no connection on a DEALER), and
    LinkError if a ROUTER's peer is gone."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLOUT) == 0:
        raise LinkTimeout(f"send: socket not writable within {timeout_s:g} s")
    frames = [packet] if routing_id is None else [routing_id, packet]
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        raise LinkTimeout("send: would block") from None
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            raise LinkError("send: peer not connected") from None
        raise LinkError(f"send: {exc}") from None


def recv_packet(sock: zmq.Socket, *, timeout_s: float) -> Received | None:
    """The next packet, or None if none arrives within `timeout_s`."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN) == 0:
        return None
    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    routing_id = None
    if sock.type == zmq.ROUTER:
        routing_id, frames = frames[0].bytes, frames[1:]
    if not frames:
        return Received(packet=b"", routing_id=routing_id, user_id=None)
    try:
        user_id = frames[-1].get("User-Id")
    except zmq.ZMQError:
        user_id = None
    user_id = user_id if isinstance(user_id, str) else None
    # A well-behaved peer sends one frame; anything else is joined so that decode rejects it.
    packet = frames[0].bytes if len(frames) == 1 else b"".join(f.bytes for f in frames)
    return Received(packet=packet, routing_id=routing_id, user_id=user_id)
