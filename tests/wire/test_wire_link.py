"""CurveZMQ links on 127.0.0.1: the right key exchanges packets, any other key gets nothing."""

from __future__ import annotations

import shutil
import stat
import time

import pytest
import zmq
import zmq.auth

from common.wire import Apid, NodeId, decode, encode
from common.wire import messages as m
from common.wire.link import (
    Endpoints,
    KeyLayout,
    LinkAuthError,
    LinkError,
    LinkTimeout,
    authorize_client,
    bound_endpoint,
    client_socket,
    init_keys,
    recv_packet,
    send_packet,
    server_socket,
    start_authenticator,
)

LOOPBACK = "tcp://127.0.0.1:*"
NOTHING_WAIT_S = 1.0
#: the deadline of a wait for something that does come (a handshake, a packet): a hang guard only
HANG_S = 120.0


@pytest.fixture
def keys(tmp_path) -> KeyLayout:
    return init_keys(tmp_path / "keys")


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def bus(context, keys):
    """The bus side: authenticator and a commands ROUTER on a free loopback port."""
    authenticator = start_authenticator(context, keys)
    router = server_socket(context, zmq.ROUTER, keys, LOOPBACK)
    yield router
    router.close(linger=0)
    authenticator.stop()


def rogue_layout(tmp_path, keys: KeyLayout, *, same_server_key: bool) -> KeyLayout:
    """Keys from another `keys init`: not authorized by the bus. Optionally with the bus's real
    server public key (so only the client key is wrong)."""
    rogue = init_keys(tmp_path / "rogue")
    if same_server_key:
        shutil.copyfile(keys.server_public, rogue.server_public)
    return rogue


def ping_packet(seq: int = 0) -> bytes:
    return encode(m.Ping(key=42), Apid.PAYLOAD, seq, source_id=NodeId.GROUND)


def test_authorized_client_exchanges_packets(context, keys, bus):
    ground = client_socket(context, zmq.DEALER, keys, "ground", bound_endpoint(bus), handshake_timeout_s=HANG_S)
    send_packet(ground, ping_packet(), timeout_s=2)
    received = recv_packet(bus, timeout_s=HANG_S)
    assert received is not None
    assert received.user_id == "ground"
    header, message = decode(received.packet)
    assert message == m.Ping(key=42)
    pong = encode(m.Pong(key=message.key), Apid.PAYLOAD, 0, source_id=NodeId.PAYLOAD)
    send_packet(bus, pong, routing_id=received.routing_id, timeout_s=2)
    reply = recv_packet(ground, timeout_s=HANG_S)
    assert reply is not None and decode(reply.packet)[1] == m.Pong(key=42)
    ground.close(linger=0)


def test_unlisted_client_key_cannot_command(tmp_path, context, keys, bus):
    rogue = rogue_layout(tmp_path, keys, same_server_key=True)
    endpoint = bound_endpoint(bus)
    with pytest.raises(LinkAuthError):
        client_socket(context, zmq.DEALER, rogue, "ground", endpoint, handshake_timeout_s=HANG_S)
    # Without waiting for the handshake, its packets simply never arrive.
    sneaky = client_socket(context, zmq.DEALER, rogue, "ground", endpoint)
    try:
        send_packet(sneaky, ping_packet(), timeout_s=0.5)
    except LinkTimeout:
        pass
    assert recv_packet(bus, timeout_s=NOTHING_WAIT_S) is None
    sneaky.close(linger=0)


def test_wrong_server_key_gets_nothing(tmp_path, context, keys, bus):
    rogue = rogue_layout(tmp_path, keys, same_server_key=False)
    # Even with an authorized client key, the handshake fails without the bus's server key.
    shutil.copyfile(keys.client_secret("ground"), rogue.client_secret("ground"))
    shutil.copyfile(keys.client_public("ground"), rogue.client_public("ground"))
    with pytest.raises(LinkAuthError):
        client_socket(context, zmq.DEALER, rogue, "ground", bound_endpoint(bus), handshake_timeout_s=1.5)
    assert recv_packet(bus, timeout_s=0.2) is None


def test_plaintext_client_gets_nothing(context, bus):
    plain = context.socket(zmq.DEALER)
    plain.connect(bound_endpoint(bus))
    if plain.poll(200, zmq.POLLOUT):  # never writable: the handshake cannot complete
        plain.send(ping_packet(), flags=zmq.NOBLOCK)
    assert recv_packet(bus, timeout_s=NOTHING_WAIT_S) is None
    plain.close(linger=0)


def test_router_reports_unknown_peer(bus):
    with pytest.raises(LinkError):
        send_packet(bus, ping_packet(), routing_id=b"nobody", timeout_s=0.5)


def test_telemetry_pub_sub_needs_the_key(tmp_path, context, keys):
    authenticator = start_authenticator(context, keys)
    pub = server_socket(context, zmq.PUB, keys, LOOPBACK)
    endpoint = bound_endpoint(pub)
    try:
        sub = client_socket(context, zmq.SUB, keys, "ground", endpoint, handshake_timeout_s=HANG_S)
        rogue = rogue_layout(tmp_path, keys, same_server_key=True)
        rogue_sub = client_socket(context, zmq.SUB, rogue, "ground", endpoint)
        hk = encode(m.Heartbeat(boot_count=1, uptime_s=2.0), Apid.PAYLOAD, 0, source_id=NodeId.PAYLOAD)
        got = None
        deadline = time.monotonic() + HANG_S
        while got is None and time.monotonic() < deadline:  # the subscription travels asynchronously
            send_packet(pub, hk, timeout_s=1)
            got = recv_packet(sub, timeout_s=0.1)
        assert got is not None and decode(got.packet)[1] == m.Heartbeat(boot_count=1, uptime_s=2.0)
        send_packet(pub, hk, timeout_s=1)
        assert recv_packet(rogue_sub, timeout_s=0.5) is None
        sub.close(linger=0)
        rogue_sub.close(linger=0)
    finally:
        pub.close(linger=0)
        authenticator.stop()


def test_newly_authorized_client_admitted_without_restart(tmp_path, context, keys, bus):
    newcomer = init_keys(tmp_path / "station2", clients=("station2",))
    shutil.copyfile(keys.server_public, newcomer.server_public)
    endpoint = bound_endpoint(bus)
    with pytest.raises(LinkAuthError):
        client_socket(context, zmq.DEALER, newcomer, "station2", endpoint, handshake_timeout_s=HANG_S)
    authorize_client(keys, "station2", newcomer.client_public("station2"))
    station = client_socket(context, zmq.DEALER, newcomer, "station2", endpoint, handshake_timeout_s=HANG_S)
    send_packet(station, ping_packet(), timeout_s=2)
    received = recv_packet(bus, timeout_s=HANG_S)
    assert received is not None and received.user_id == "station2"
    station.close(linger=0)


def test_init_keys_layout_permissions_and_idempotence(tmp_path):
    layout = init_keys(tmp_path / "keys")
    for path in (
        layout.server_public,
        layout.server_secret,
        layout.client_secret("ground"),
        layout.client_secret("payload"),
        layout.authorized_dir / "ground.key",
        layout.authorized_dir / "payload.key",
    ):
        assert path.is_file(), path
    assert stat.S_IMODE(layout.server_secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(layout.client_secret("ground").stat().st_mode) == 0o600
    assert stat.S_IMODE(layout.root.stat().st_mode) == 0o700
    assert layout.state_dir.is_dir()
    server_key = zmq.auth.load_certificate(layout.server_public)[0]
    init_keys(tmp_path / "keys")
    assert zmq.auth.load_certificate(layout.server_public)[0] == server_key  # kept
    init_keys(tmp_path / "keys", force=True)
    assert zmq.auth.load_certificate(layout.server_public)[0] != server_key  # replaced


def test_client_names_must_be_safe(tmp_path):
    from common.wire import WireError

    with pytest.raises(WireError):
        init_keys(tmp_path / "keys", clients=("../evil",))


def test_endpoints_from_environment():
    assert Endpoints.from_env({}) == Endpoints()
    custom = Endpoints.from_env({"OW_COMMANDS_ENDPOINT": "tcp://127.0.0.1:6000"})
    assert custom.commands == "tcp://127.0.0.1:6000" and custom.telemetry == Endpoints().telemetry


def test_stations_are_bound_to_source_ids_and_connections_carry_their_key(tmp_path, context):
    """Finding 7b: init_keys binds ground to 0x0001 (admin), each other station to the next free
    station id and each admin to the next free admin id; the payload gets no binding; a source id
    is bound to one key only; a received packet names its key and connection."""
    from common.wire.link import bind_station, read_binding, station_bindings, station_source_id

    keys = init_keys(tmp_path / "keys", clients=("station2", "ground", "payload"), admins=("ops",))
    assert station_bindings(keys) == {"ground": 0x0001, "station2": 0x0010, "ops": 0x0002}
    assert station_source_id(keys, "station2") == 0x0010
    assert station_source_id(keys, "payload") is None
    init_keys(keys.root, clients=("station3",))  # a second run keeps what is bound
    assert station_bindings(keys) == {"ground": 0x0001, "station2": 0x0010, "ops": 0x0002, "station3": 0x0011}
    with pytest.raises(ValueError, match="already bound"):
        bind_station(keys, "station3", 0x0010)
    with pytest.raises(ValueError, match="not a ground station"):
        bind_station(keys, "station3", 0x0100)
    keys.binding_path("station3").write_text("{not json")
    with pytest.raises(ValueError, match="not a station binding"):
        read_binding(keys.binding_path("station3"))
    assert "station3" not in station_bindings(keys)

    authenticator = start_authenticator(context, keys)
    router = server_socket(context, zmq.ROUTER, keys, LOOPBACK)
    try:
        dealer = client_socket(
            context, zmq.DEALER, keys, "station2", bound_endpoint(router), handshake_timeout_s=HANG_S
        )
        send_packet(dealer, encode(m.Ping(key=1), Apid.PAYLOAD, 1, source_id=0x0010))
        got = recv_packet(router, timeout_s=HANG_S)
        assert got is not None and got.user_id == "station2"
        public, _ = zmq.auth.load_certificate(keys.client_public("station2"))
        assert got.key == public.decode("ascii")
        assert got.fd is not None and got.fd >= 0
        assert authenticator.keys.binding("station2") == 0x0010
    finally:
        router.close(linger=0)
        authenticator.stop()
