"""The link: no answer (exit 4, clear message), no bus, an unlisted key or a wrong bus key gets
no service, and the telecommand sequence counter never reuses a number across restarts or
concurrent ground processes (and resynchronises when its file was lost)."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import zmq.auth
from ground_testkit import HANDSHAKE_HANG_S, link_args

from common.wire import Apid, MessageType
from common.wire.link import init_keys
from ground.state import SharedSequenceCounter


def test_silent_payload_is_no_answer_exit_4_with_the_reason(ow, keys, peer):
    peer.powered, peer.off_until = False, None  # the bus is up and stores; the payload never answers
    result = ow("ground", "status", *link_args(keys, peer, timeout=1.0))
    assert result.code == 4
    [line] = result.err.strip().splitlines()
    assert line.startswith("ow ground: error: STATUS: no answer within 1 s")
    assert "payload not answering; commands are queued at the bus" in line
    assert len(peer.backlog) == 1  # the command waits at the bus, as the message says


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_bus_is_no_answer_exit_4(ow, keys):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    result = ow(
        "ground",
        "ping",
        "--keys",
        keys.root,
        "--commands-endpoint",
        endpoint,
        "--telemetry-endpoint",
        endpoint,
        "--timeout",
        "60",
        "--handshake-timeout",
        "1",  # nobody listens there: the handshake fails however long it is given
    )
    assert result.code == 4
    # The handshake's own deadline ended it, not the (much longer) answer timeout.
    assert f"no CURVE handshake with the bus at {endpoint} (telemetry link) within 1 s" in result.err
    assert len(result.err.strip().splitlines()) == 1


class HeldRelay:
    """A TCP relay to `upstream` that holds every connection until `release()`: a bus that takes
    its time to accept a station, as a loaded machine's does."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.released = threading.Event()
        self.accepted = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.accepted.set()
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        self.released.wait()
        server = socket.create_connection(self.upstream)
        self.sockets += [client, server]
        for source, sink in ((client, server), (server, client)):
            threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass  # the other side closed
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.released.set()
        self.listener.close()
        for s in self.sockets:
            s.close()


def test_a_handshake_slower_than_the_answer_timeout_still_connects(ow, keys, peer):
    # The bus holds the station's connections for longer than --timeout before the handshake can
    # even start; the handshake has its own deadline, so the command goes out and the silent
    # payload is reported as what it is (no answer within --timeout), not as an unreachable bus.
    peer.powered, peer.off_until = False, None
    commands, telemetry = HeldRelay(peer.commands_endpoint), HeldRelay(peer.telemetry_endpoint)
    timeout_s = 0.5

    def release_after_the_timeout() -> None:
        telemetry.accepted.wait()
        # Waiting at least this long is certain on any machine: the handshake outlasts --timeout.
        time.sleep(3 * timeout_s)
        telemetry.released.set()
        commands.released.set()

    releaser = threading.Thread(target=release_after_the_timeout, daemon=True)
    releaser.start()
    try:
        result = ow(
            "ground",
            "status",
            "--keys",
            keys.root,
            "--commands-endpoint",
            commands.endpoint,
            "--telemetry-endpoint",
            telemetry.endpoint,
            "--timeout",
            str(timeout_s),
            "--handshake-timeout",
            str(HANDSHAKE_HANG_S),
        )
    finally:
        releaser.join(HANDSHAKE_HANG_S)
        commands.close()
        telemetry.close()
    assert result.code == 4, result.err
    assert "STATUS: no answer within 0.5 s: payload not answering" in result.err, result.err
    assert len(peer.backlog) == 1  # the command went through the held link and waits at the bus


def test_handshake_timeout_must_be_a_finite_positive_number(ow, keys, peer):
    for bad in ("0", "-1", "nan", "inf"):
        result = ow("ground", "status", *link_args(keys, peer), "--handshake-timeout", bad)
        assert result.code == 5, (bad, result.err)
        assert "--handshake-timeout must be a finite number > 0" in result.err


def test_unlisted_station_key_gets_no_service(ow, keys, peer):
    # A key pair in the station's own directory, with the right bus key, that the bus never admitted.
    zmq.auth.create_certificates(keys.clients_dir, "intruder")
    result = ow("ground", "status", *link_args(keys, peer, timeout=2.0), "--station", "intruder")
    assert result.code == 4
    assert "refused station 'intruder'" in result.err and "not in the bus's authorized/ directory" in result.err
    assert peer.commands == []


def test_keys_from_another_installation_get_no_service(ow, keys, peer, tmp_path):
    rogue = init_keys(tmp_path / "rogue")
    wrong_bus_key = ow("ground", "status", *link_args(rogue, peer, timeout=1.0))
    assert wrong_bus_key.code == 4 and "bus.key is not the public key of this bus" in wrong_bus_key.err
    shutil.copyfile(keys.server_public, rogue.server_public)
    unlisted = ow("ground", "status", *link_args(rogue, peer, timeout=2.0))
    assert unlisted.code == 4 and "refused" in unlisted.err
    assert peer.commands == []


def test_sequence_numbers_never_repeat_across_ground_restarts(ow, keys, peer):
    for _ in range(3):
        assert ow("ground", "ping", *link_args(keys, peer)).code == 0
        assert ow("ground", "status", *link_args(keys, peer)).code == 0
    numbers = peer.sequence_numbers()
    assert len(numbers) == 6
    assert numbers == sorted(set(numbers))  # strictly increasing: every restart continued past the last
    assert peer.replays == []
    assert (keys.state_dir / "tc-sequence.bin").exists()


def test_a_lost_counter_is_resynchronised_from_the_payloads_rejection(ow, keys, peer):
    assert ow("ground", "ping", *link_args(keys, peer)).code == 0
    (keys.state_dir / "tc-sequence.bin").unlink()  # the ground's state is lost
    result = ow("ground", "ping", *link_args(keys, peer))
    assert result.code == 0, result.err
    assert "sequence counter moved past it" in result.err
    assert len(peer.replays) == 1  # the reused number was refused by the payload ...
    assert len(peer.commands_of(MessageType.PING)) == 2  # ... and the ping went through under a new one


def test_concurrent_ground_processes_never_share_a_sequence_number(tmp_path):
    path, lock = tmp_path / "tc-sequence.bin", tmp_path / "ground.lock"
    drawn: list[list[int]] = [[], [], []]

    def draw(out: list[int]) -> None:
        counter = SharedSequenceCounter(path, lock, reserve=4)
        for _ in range(200):
            out.append(counter.next(Apid.PAYLOAD))

    threads = [threading.Thread(target=draw, args=(out,)) for out in drawn]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = [n for out in drawn for n in out]
    assert len(everything) == 600 and len(set(everything)) == 600
    assert all(out == sorted(out) for out in drawn)
    # A restart continues after every number any of them issued.
    assert SharedSequenceCounter(path, lock).next(Apid.PAYLOAD) > max(everything)
