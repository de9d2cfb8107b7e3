"""A minimal scripted bus for running the payload process alone: a CURVE ROUTER on the payload
link that sends telecommands as a ground station would and collects every packet the payload
sends. (The real bus is `ow bus run`; end-to-end tests use it.) The payload tests drive
`ow flight run` with it, and so does bench/cold_start.py, which times the process's start."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import zmq

from common.wire import Apid, NodeId, SequenceCounter, decode, encode
from common.wire import messages as m
from common.wire.link import bound_endpoint, init_keys, recv_packet, send_packet, server_socket, start_authenticator

#: How long a wait for a packet lasts before it is called a hang: waits end when the packet
#: arrives, and a payload on a loaded machine (a model loading, a task ahead in the queue) may
#: take many times the usual seconds to answer.
HANG_S = 300.0


class BusPeer:
    def __init__(self, keys_dir: str):
        self.layout = init_keys(keys_dir)
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, self.layout)
        self.sock = server_socket(self.ctx, zmq.ROUTER, self.layout, "tcp://127.0.0.1:0")
        self.endpoint = bound_endpoint(self.sock)
        self.payload_id: bytes | None = None
        self.counter = SequenceCounter()
        self.received: list[tuple[object, m.Message]] = []

    def close(self):
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()

    def pump(self, seconds: float):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            r = recv_packet(self.sock, timeout_s=0.05)
            if r is None:
                continue
            self.payload_id = r.routing_id
            header, msg = decode(r.packet)
            self.received.append((header, msg))

    def wait_for(self, predicate, timeout: float = HANG_S, start: int = 0):
        end = time.monotonic() + timeout
        i = start
        while time.monotonic() < end:
            while i < len(self.received):
                if predicate(*self.received[i]):
                    return self.received[i]
                i += 1
            self.pump(0.1)
        raise TimeoutError("expected packet never arrived")

    def wait_connected(self, timeout: float = HANG_S):
        self.wait_for(lambda h, msg: isinstance(msg, m.Heartbeat), timeout)

    def command(self, message, seq: int | None = None, source_id: int = NodeId.GROUND) -> int:
        """Send a telecommand as ground station `source_id` would (through a real bus, the one
        its key is bound to). One counter serves every source: each sees gaps, which is fresh."""
        seq = self.counter.next(Apid.PAYLOAD) if seq is None else seq
        send_packet(self.sock, encode(message, Apid.PAYLOAD, seq, source_id=source_id), routing_id=self.payload_id)
        return seq

    def answer(self, message, source_id: int = NodeId.GROUND, timeout: float = HANG_S):
        """Send a telecommand and wait for its REJECTED, or its ACCEPTED: the report."""
        seq = self.command(message, source_id=source_id)
        return self.wait_for(lambda h, msg: isinstance(msg, (m.Accepted, m.Rejected)) and msg.tc_seq == seq, timeout)[1]

    def raw(self, packet: bytes):
        send_packet(self.sock, packet, routing_id=self.payload_id)

    def reports_for(self, seq: int):
        return [msg for h, msg in self.received if isinstance(msg, m.Verification) and msg.tc_seq == seq]


def spawn_flight(data_dir, model_dir, keys_dir, endpoint, *extra, log_path=None, launcher=("-m", "common.cli")):
    """`ow flight run` on the scripted bus. `launcher`: the interpreter's arguments before `flight
    run` (a test passes a script that records the process's imports and then runs `ow`)."""
    cmd = [
        sys.executable,
        *launcher,
        "flight",
        "run",
        "--data-dir",
        str(data_dir),
        "--model",
        model_dir,
        "--keys",
        str(keys_dir),
        "--payload-endpoint",
        endpoint,
        "--chunk",
        "16",
        "--group",
        "2",
        "--decode-every",
        "2",
        "--vision-every",
        "1",
        "--threads",
        "1",
        *extra,
    ]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(
        cmd, stdout=log, stderr=log, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True
    )
