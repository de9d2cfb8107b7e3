"""Test payload of the skip-idle tests (tests/bus/test_skip_idle_races.py): a stand-in for `ow flight
run` that the bus spawns, kills and spawns again. It speaks the real wire protocol over a real CURVE
DEALER link, and its first boot can withhold what it would answer, so that the cut that ends that
boot takes the answers of a command it has already run -- in the order the test chooses, instead of
at an instant the test would have to hit.

Every boot sends a HEARTBEAT (no task) and a HOUSEKEEPING report (empty queue) every
--heartbeat-s: an idle payload. Each telecommand's number goes to the replay guard, durably (one
fsynced line in --record), before anything about it is sent; a number already there is answered
REJECTED REPLAYED_SEQUENCE (the redelivery of a command run before a cut). The answers: ACCEPTED,
PONG for PING, COMPLETED; --first-boot-answers says what the first boot sends of them (`all`,
`accepted`: ACCEPTED only, `none`). Record lines:

    {"ev": "boot", "boot": n, "pid": p}
    {"ev": "accepted", "boot": n, "type": "PING", "source": s, "seq": q}
    {"ev": "replayed", "boot": n, "type": "PING", "source": s, "seq": q}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import zmq

from common.wire import Apid, NodeId, ReplayError, ReplayGuard, WireError, decode, encode
from common.wire import messages as m
from common.wire.link import KeyLayout, client_socket, recv_packet, send_packet


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--heartbeat-s", type=float, default=0.2)
    parser.add_argument("--first-boot-answers", choices=("all", "accepted", "none"), default="all")
    args = parser.parse_args()

    guard = ReplayGuard()
    boot = 1
    if os.path.exists(args.record):
        with open(args.record) as f:
            for line in f:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line a SIGKILL tore
                if obj["ev"] == "boot":
                    boot = obj["boot"] + 1
                elif obj["ev"] == "accepted":
                    guard.record(Apid.PAYLOAD, obj["source"], obj["seq"])
    fd = os.open(args.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(ev: str, **fields) -> None:
        os.write(fd, (json.dumps({"ev": ev, "boot": boot, **fields}) + "\n").encode())
        os.fsync(fd)

    note("boot", pid=os.getpid())
    answers = args.first_boot_answers if boot == 1 else "all"
    ctx = zmq.Context()
    sock = client_socket(ctx, zmq.DEALER, KeyLayout(Path(args.keys)), "payload", args.endpoint)
    tm_seq = 0

    def send(message: m.Message) -> None:
        nonlocal tm_seq
        send_packet(sock, encode(message, Apid.PAYLOAD, tm_seq, source_id=NodeId.PAYLOAD), timeout_s=2)
        tm_seq += 1

    started = time.monotonic()
    next_heartbeat = 0.0
    while True:
        now = time.monotonic()
        if now >= next_heartbeat:
            next_heartbeat = now + args.heartbeat_s
            send(m.Heartbeat(boot_count=boot, uptime_s=now - started))
            send(
                m.Housekeeping(
                    queue_depth=0,
                    current_task=None,
                    phase=None,
                    progress_done=0,
                    progress_total=0,
                    checkpoint_bytes=0,
                    disk_free_bytes=0,
                    boot_count=boot,
                    command_count=0,
                    error_count=0,
                    uptime_s=now - started,
                )
            )
        received = recv_packet(sock, timeout_s=0.02)
        if received is None:
            continue
        try:
            header, message = decode(received.packet)
        except WireError:
            continue
        if not message.is_command():
            continue  # the bus's power state and warnings
        request = header.request
        fields = {"type": message.TYPE.name, "source": request.source_id, "seq": request.seq}
        try:
            guard.record(request.apid, request.source_id, request.seq)
        except ReplayError as exc:
            note("replayed", **fields)
            send(m.Rejected.from_error(exc, request))
            continue
        note("accepted", **fields)  # the command's effect, durable before any answer
        if answers in ("all", "accepted"):
            send(m.Accepted.about(request))
        if answers == "all":
            if isinstance(message, m.Ping):
                send(m.Pong(key=message.key))
            send(m.Completed.about(request))


if __name__ == "__main__":
    sys.exit(main())
