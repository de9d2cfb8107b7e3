"""ZeroMQ links with CurveZMQ authentication (docs/wire-protocol.md §7).

The bus is the CURVE server of every link: it binds a ROUTER for ground stations (commands),
a ROUTER for the payload, and a PUB for telemetry. Ground tools and the payload connect as
CURVE clients; the bus's authenticator admits only public keys found in the keys directory's
`authorized/` folder and names each connection after its key file and key (ZMQ "User-Id",
`<name>|<z85 public key>`; `recv_packet` splits it into `Received.user_id` and `.key`). Each
station key is bound to one source id by `authorized/<name>.station` (docs/wire-protocol.md §7).

Each ZeroMQ message is exactly one packet (one frame; ROUTER sockets add the routing id frame),
so a subscriber can filter on the packet's first two bytes (version, type, APID).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
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
from common.wire.errors import WireError
from common.wire.fields import check_name
from common.wire.ids import ADMIN_SOURCE_IDS, MAX_PACKET_BYTES, STATION_SOURCE_IDS, NodeId

SERVER_NAME = "bus"
DEFAULT_CLIENTS = ("ground", "payload")
#: The payload's key: it speaks on the payload link, never as a ground station, so it has no
#: station binding.
PAYLOAD_CLIENT = "payload"
#: The default ground key: bound to the first admin id (0x0001, NodeId.GROUND) by `init_keys`.
GROUND_CLIENT = "ground"
#: A station binding's file suffix, beside the key: authorized/<name>.station.
BINDING_SUFFIX = ".station"
#: Separates the key name from the z85 public key in a connection's User-Id (not a z85 character).
USER_ID_SEPARATOR = "|"
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
        clients/<name>.station                         the station's binding (a copy for the ground)
        authorized/<name>.key                          public keys the bus admits
        authorized/<name>.station                      the source id the bus binds to that key
        state/                                         the ground's durable sequence counter

    A deployed ground station keeps only its own client pair and binding, server/bus.key and
    state/; the bus keeps server/ and authorized/; the payload keeps its client pair and
    server/bus.key.
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

    def binding_path(self, name: str) -> Path:
        """The bus's binding of key `name` to a source id (authorized/<name>.station)."""
        return self.authorized_dir / f"{name}{BINDING_SUFFIX}"

    def client_binding_path(self, name: str) -> Path:
        """The ground station's copy of its binding (clients/<name>.station)."""
        return self.clients_dir / f"{name}{BINDING_SUFFIX}"

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
    keys_dir: str | os.PathLike,
    clients: tuple[str, ...] = DEFAULT_CLIENTS,
    *,
    force: bool = False,
    admins: tuple[str, ...] = (),
) -> KeyLayout:
    """Create the server key pair and one pair per client, authorize the clients and bind each
    ground station to a source id (`bind_station`; `admins`, also created, to admin ids).

    Existing key pairs and bindings are kept (running it twice changes nothing) unless `force`,
    which replaces every pair named here — clients then need the new server public key."""

    layout = KeyLayout(Path(keys_dir))
    clients = tuple(dict.fromkeys([*clients, *admins]))
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
    # Bindings: an existing one is kept (a key keeps its source id, so its tasks stay its own);
    # `ground` takes 0x0001, the names in `admins` the next free admin id, every other station
    # the next free station id; the payload is no station.
    for name in clients:
        if name == PAYLOAD_CLIENT or read_binding(layout.binding_path(name)) is not None:
            continue
        if name == GROUND_CLIENT and NodeId.GROUND not in station_bindings(layout).values():
            bind_station(layout, name, source_id=NodeId.GROUND)
        else:
            bind_station(layout, name, admin=name in admins)
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


@dataclass(frozen=True)
class StationBinding:
    """Key `name` speaks as source id `source_id` (docs/wire-protocol.md §7 "Stations"). Whether
    it is an admin station follows from the id (ADMIN_SOURCE_IDS): the payload decides by the
    source id alone, so the file holds nothing that could say otherwise."""

    name: str
    source_id: int

    @property
    def admin(self) -> bool:
        return self.source_id in ADMIN_SOURCE_IDS

    @property
    def role(self) -> str:
        return "admin" if self.admin else "station"


def _check_source_id(source_id: object) -> int:
    if isinstance(source_id, bool) or not isinstance(source_id, int):
        raise ValueError(f"source id {source_id!r} is not an integer")
    if source_id not in ADMIN_SOURCE_IDS and source_id not in STATION_SOURCE_IDS:
        raise ValueError(f"source id {source_id:#06x} is not a ground station's (0x0001..0x00FF)")
    return source_id


def read_binding(path: str | os.PathLike) -> int | None:
    """The source id in a binding file (`{"source_id": N}`), or None when there is none.
    A damaged file raises ValueError naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return _check_source_id(data.get("source_id"))
    except ValueError as exc:
        raise ValueError(f"{path}: not a station binding ({exc})") from None


def station_bindings(layout: KeyLayout) -> dict[str, int]:
    """Every binding in authorized/, by key name (damaged files are left out and logged)."""
    return _bindings_of(sorted(layout.authorized_dir.glob(f"*{BINDING_SUFFIX}")))


def _bindings_of(paths) -> dict[str, int]:
    found: dict[str, int] = {}
    for path in paths:
        try:
            source_id = read_binding(path)
        except (OSError, ValueError) as exc:
            _log.warning("link_binding_unreadable", path=str(path), error=str(exc))
            continue
        if source_id is not None:
            found[path.name[: -len(BINDING_SUFFIX)]] = source_id
    return found


def next_free_source_id(layout: KeyLayout, *, admin: bool = False) -> int:
    used = set(station_bindings(layout).values())
    ids = ADMIN_SOURCE_IDS if admin else STATION_SOURCE_IDS
    for source_id in ids:
        if source_id not in used:
            return source_id
    raise ValueError(f"every {'admin' if admin else 'station'} source id ({ids[0]:#06x}..{ids[-1]:#06x}) is bound")


def _write_small(path: Path, text: str) -> None:
    # lazy: durable imports nothing heavy, but the link module is imported by `ow --help`
    from common.durable import DurableFS

    DurableFS().write_atomic(str(path), [text.encode("utf-8")])


def bind_station(layout: KeyLayout, name: str, source_id: int | None = None, *, admin: bool = False) -> StationBinding:
    """Bind key `name` to `source_id` (default: the next free admin or station id): write
    authorized/<name>.station (the bus's, read again without a restart) and, where this keys
    directory holds the station's own pair, clients/<name>.station (the ground tools' default
    source id). A source id bound to another key is refused (ValueError): two keys speaking as
    one station would share its tasks and its replay window."""
    try:
        check_name(name, "station name")
    except WireError as exc:
        raise ValueError(exc.reason) from None
    if source_id is None:
        current = read_binding(layout.binding_path(name))
        if current is not None and (current in ADMIN_SOURCE_IDS) == admin:
            source_id = current
        else:
            source_id = next_free_source_id(layout, admin=admin)
    source_id = _check_source_id(source_id)
    for other, bound in station_bindings(layout).items():
        if bound == source_id and other != name:
            raise ValueError(f"source id {source_id:#06x} is already bound to key {other!r}")
    _private_dir(layout.authorized_dir)
    text = json.dumps({"source_id": source_id}) + "\n"
    _write_small(layout.binding_path(name), text)
    if layout.client_public(name).exists() or layout.client_secret(name).exists():
        _write_small(layout.client_binding_path(name), text)
    _log.info("link_station_bound", name=name, source_id=source_id)
    return StationBinding(name, source_id)


def station_source_id(layout: KeyLayout, name: str) -> int | None:
    """The source id key `name` is bound to, as this keys directory knows it: the bus's
    authorized/<name>.station, else the ground's clients/<name>.station; None if neither."""
    for path in (layout.binding_path(name), layout.client_binding_path(name)):
        source_id = read_binding(path)
        if source_id is not None:
            return source_id
    return None


class AuthorizedKeys:
    """Credentials provider for pyzmq's authenticator: the public keys in one directory, reread
    whenever the directory changes, each named after its file, and the station bindings beside
    them. Thread-safe: the authenticator's thread and the bus's main loop both read it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._names: dict[bytes, str] = {}
        self._keys: dict[str, bytes] = {}
        self._bindings: dict[str, int] = {}

    def _refresh(self) -> None:
        try:
            entries = sorted(self.directory.glob("*.key"))
            bound = sorted(self.directory.glob(f"*{BINDING_SUFFIX}"))
            stamp = tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in [*entries, *bound])
        except OSError:
            entries, bound, stamp = [], [], ()
        if stamp == self._stamp:
            return
        names: dict[bytes, str] = {}
        for path in entries:
            try:
                public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError):
                _log.warning("link_key_unreadable", path=str(path))
                continue
            if public:
                names[public] = path.stem
        bindings = _bindings_of(bound)
        self._names, self._stamp, self._bindings = names, stamp, bindings
        self._keys = {name: key for key, name in names.items()}

    def refresh(self) -> None:
        with self._lock:
            self._refresh()

    def name_of(self, z85_key: bytes) -> str | None:
        with self._lock:
            self._refresh()
            return self._names.get(z85_key)

    def snapshot(self) -> dict[str, bytes]:
        """Key name -> z85 public key of every authorized key, as of the last refresh."""
        with self._lock:
            return dict(self._keys)

    def binding(self, name: str) -> int | None:
        """The source id key `name` is bound to (authorized/<name>.station), as of the last refresh."""
        with self._lock:
            return self._bindings.get(name)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        name = self.name_of(z85_key)
        if name is None:
            _log.warning("link_auth_denied", domain=domain, client_key=z85_key.decode("ascii", "replace"))
            return False
        _log.info("link_auth_allowed", domain=domain, client=name)
        return True


class CurveAuthenticator(ThreadAuthenticator):
    """ZAP handler admitting only the public keys in `authorized_dir`; the authenticated
    connection's User-Id is `<name>|<z85 public key>` (name: the key file stem), so that a
    server can tell a key that was revoked or replaced from the one now filed under its name."""

    def __init__(self, context: zmq.Context, authorized_dir: str | os.PathLike):
        super().__init__(context)
        self.keys = AuthorizedKeys(Path(authorized_dir))

    def start(self) -> None:
        super().start()
        self.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self.keys)

    def curve_user_id(self, client_public_key: bytes) -> str:
        z85_key = z85.encode(client_public_key)
        name = self.keys.name_of(z85_key) or "unknown"
        return f"{name}{USER_ID_SEPARATOR}{z85_key.decode('ascii')}"


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


_MONITOR_NUMBERS = itertools.count()


def monitor_socket(sock: zmq.Socket, events: int | None = None) -> zmq.Socket:
    """`sock.get_monitor_socket(events)` on an inproc address of its own. pyzmq's default names
    the address after the socket, and a closed socket's monitor endpoint is released by ZeroMQ's
    reaper thread later: a new socket at the same place could then fail with "Address already in
    use" (seen on a loaded machine)."""
    return sock.get_monitor_socket(events, addr=f"inproc://ow-monitor-{os.getpid()}-{next(_MONITOR_NUMBERS)}")


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
        monitor = monitor_socket(sock) if handshake_timeout_s is not None else None
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
    #: Its z85 public key, as authenticated when the connection was made.
    key: str | None = None
    #: The file descriptor of the TCP connection it came on (ZMQ_SRCFD): a server may shut that
    #: one connection down (libzmq's ROUTER has no call to drop a single peer).
    fd: int | None = None


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
    key = None
    if user_id is not None and USER_ID_SEPARATOR in user_id:
        user_id, _, key = user_id.rpartition(USER_ID_SEPARATOR)
    try:
        fd = frames[-1].get(zmq.SRCFD)
    except zmq.ZMQError:
        fd = None
    # A well-behaved peer sends one frame; anything else is joined so that decode rejects it.
    packet = frames[0].bytes if len(frames) == 1 else b"".join(f.bytes for f in frames)
    return Received(
        packet=packet,
        routing_id=routing_id,
        user_id=user_id,
        key=key,
        fd=fd if isinstance(fd, int) and fd >= 0 else None,
    )
