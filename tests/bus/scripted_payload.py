"""Scripted test payload: a stand-in for `ow flight run` that the bus tests spawn as its payload.

It is a test peer for the bus, not a model of the flight software. It speaks the real wire
protocol over a real CURVE DEALER link: a HEARTBEAT at once and every --heartbeat-s, ACCEPTED
(or REJECTED REPLAYED_SEQUENCE) for every telecommand, PONG for PING, COMPLETED. Everything it
experiences goes to --record, one JSON object per line:

    {"ev": "boot", "boot": n, "pid": p, "t": unix time}
    {"ev": "tick", "boot": n, "t": ...}                       every --tick-s: "still alive"
    {"ev": "accepted", "boot": n, "type": "PING", "source": s, "seq": q, "task_id": ..., "t": ...}
    {"ev": "replayed", ...same fields}                        rejected by the replay guard
    {"ev": "bus_tm", "boot": n, "type": "SHUTDOWN_WARNING", "lead_time_s": ..., "cause": ..., "t": ...}
    {"ev": "muted", "boot": n, "t": ...}                      --hang-after/--mute-after took effect

The `accepted` line is the command's one durable effect and its commit point: the replay guard
is rebuilt from those lines at boot, so a command is executed at most once across SIGKILLs
whatever instant the kill lands on (one O_APPEND write either happened or did not).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import zmq

from common.wire import (
    AckFlags,
    Apid,
    NodeId,
    ReplayError,
    ReplayGuard,
    RequestRef,
    TaskPhase,
    WireError,
    decode,
    encode,
)
from common.wire import messages as m
from common.wire.link import KeyLayout, client_socket, recv_packet, send_packet


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--client", default="payload")
    parser.add_argument("--heartbeat-s", type=float, default=0.2)
    parser.add_argument("--tick-s", type=float, default=0.02)
    parser.add_argument(
        "--hang-after",
        type=float,
        default=None,
        help="first boot only: from this many seconds after boot, read and send nothing (alive but hung)",
    )
    parser.add_argument(
        "--mute-after",
        type=float,
        default=None,
        help="first boot only: from this many seconds after boot, execute commands but send nothing",
    )
    parser.add_argument(
        "--exit-after",
        type=float,
        default=None,
        help="exit with status 3 this many seconds after boot, on the first boot only",
    )
    parser.add_argument(
        "--work-then-exit",
        type=float,
        default=None,
        help="every boot: this many seconds after boot, report a unit of a task's work (PROGRESS), "
        "then exit with status 3 (a payload at work that something kills now and then)",
    )
    parser.add_argument(
        "--work-s",
        type=float,
        default=0.0,
        help="seconds each command takes to execute, between its effect and its reports",
    )
    parser.add_argument(
        "--idle-housekeeping",
        action="store_true",
        help="with each heartbeat, a HOUSEKEEPING report of an empty queue (an idle payload)",
    )
    parser.add_argument(
        "--honour-ack-flags",
        action="store_true",
        help="send ACCEPTED / COMPLETED only when the telecommand asked for them",
    )
    parser.add_argument(
        "--connect-after",
        metavar="PATH",
        help="connect to the bus only once PATH exists: a gate the test opens, so that commands wait "
        "in the bus's store for as long as the test needs, however fast or slow the machine",
    )
    args = parser.parse_args()

    guard = ReplayGuard()
    boot = 1
    if os.path.exists(args.record):
        with open(args.record) as f:
            for line in f:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if obj["ev"] == "boot":
                    boot = obj["boot"] + 1
                elif obj["ev"] == "accepted":
                    guard.record(Apid.PAYLOAD, obj["source"], obj["seq"])
    record = open(args.record, "a", buffering=1)

    def note(ev: str, **fields) -> None:
        record.write(json.dumps({"ev": ev, "boot": boot, "t": time.time(), **fields}) + "\n")

    note("boot", pid=os.getpid())
    while args.connect_after is not None and not os.path.exists(args.connect_after):
        time.sleep(0.02)
    ctx = zmq.Context()
    sock = client_socket(ctx, zmq.DEALER, KeyLayout(Path(args.keys)), args.client, args.endpoint)
    tm_seq = 0

    def send(message: m.Message) -> None:
        nonlocal tm_seq
        if muted:
            return
        send_packet(sock, encode(message, Apid.PAYLOAD, tm_seq, source_id=NodeId.PAYLOAD), timeout_s=2)
        tm_seq += 1

    started = time.monotonic()
    muted = False
    next_heartbeat = next_tick = 0.0
    while True:
        now = time.monotonic()
        uptime = now - started
        first_boot = boot == 1
        if first_boot and args.exit_after is not None and uptime >= args.exit_after:
            note("exit", status=3)
            return 3
        if args.work_then_exit is not None and uptime >= args.work_then_exit:
            unit = RequestRef(apid=Apid.PAYLOAD, source_id=NodeId.GROUND, seq=0, message_type=0x0110)
            send(m.Progress.about(unit, task_id="t-work", phase=TaskPhase.DECODE, done=1, total=2))
            time.sleep(0.1)  # the report leaves before the process does
            note("exit", status=3)
            return 3
        hung = first_boot and args.hang_after is not None and uptime >= args.hang_after
        was_muted = muted
        muted = hung or (first_boot and args.mute_after is not None and uptime >= args.mute_after)
        if muted and not was_muted:
            note("muted")  # from here on nothing leaves (tests wait for this line)
        if now >= next_tick:
            next_tick = now + args.tick_s
            note("tick")
        if now >= next_heartbeat and not muted:
            next_heartbeat = now + args.heartbeat_s
            send(m.Heartbeat(boot_count=boot, uptime_s=uptime))
            if args.idle_housekeeping:
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
                        uptime_s=uptime,
                    )
                )
        received = recv_packet(sock, timeout_s=min(args.tick_s, 0.02))
        if received is None or hung:
            continue
        try:
            header, message = decode(received.packet)
        except WireError as exc:
            note("undecodable", code=exc.code.name)
            continue
        if not message.is_command():
            note(
                "bus_tm",
                type=message.TYPE.name,
                **{k: (v.value if hasattr(v, "value") else v) for k, v in message.pack().items()},
            )
            continue
        request = header.request
        fields = {
            "type": message.TYPE.name,
            "source": request.source_id,
            "seq": request.seq,
            "task_id": getattr(message, "task_id", None),
        }
        try:
            guard.record(request.apid, request.source_id, request.seq)
        except ReplayError as exc:
            note("replayed", **fields)
            send(m.Rejected.from_error(exc, request))
            continue
        note("accepted", **fields)
        if args.work_s:
            time.sleep(args.work_s)  # a cut in here takes the reports of an executed command
        if header.wants(AckFlags.ACCEPTANCE) or not args.honour_ack_flags:
            send(m.Accepted.about(request, task_id=fields["task_id"]))
        if isinstance(message, m.Ping):
            send(m.Pong(key=message.key))
        if header.wants(AckFlags.COMPLETION) or not args.honour_ack_flags:
            send(m.Completed.about(request, task_id=fields["task_id"]))


if __name__ == "__main__":
    sys.exit(main())
