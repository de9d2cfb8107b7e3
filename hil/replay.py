"""Telemetry replay: re-drive a recorded bus run against the current build and compare.

Every bus run leaves a run log (docs/bus.md §7). `replay(log)` starts a fresh bus and payload on
the same trace and time scale (so the same cuts at the same instants), re-sends every recorded
telecommand -- the same packet bytes -- at the same offset from the start of the run, lets the
run play out, and compares what matters, robustly against timing jitter:

    power      the cut timeline driven by the trace (kind, cause, warning leads)
    commands   for each telecommand, how it ended: accepted, or rejected with which code
    tasks      for each task, which reports it got (accepted, started, completed or failed) and
               its answer: token ids and logits hash, bit for bit

Any difference is a divergence. Interleavings that legitimately vary from run to run (how many
PROGRESS reports, the exact unit a cut lands in) are not compared.
"""
from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from common.wire.link import Endpoints, client_socket, init_keys, recv_packet, send_packet
from hil import buslog as bl


@dataclass
class RunDigest:
    """The comparable essence of one recorded run."""

    power: list[tuple]
    commands: dict[tuple, str]
    tasks: dict[str, dict]
    model: str | None = None
    machine: dict | None = None

    def differences(self, other: "RunDigest") -> list[str]:
        out = []
        if self.power != other.power:
            out.append(f"power timeline: recorded {self.power} vs replayed {other.power}")
        for key in sorted(set(self.commands) | set(other.commands), key=str):
            a, b = self.commands.get(key), other.commands.get(key)
            if key[2] == "DOWNLINK_RESULT" and "RESULT_NOT_READY" in f"{a} {b}":
                continue  # a result poll: whether the task had finished yet depends on timing
            if a != b:
                out.append(f"command {key}: recorded {a} vs replayed {b}")
        for task in sorted(set(self.tasks) | set(other.tasks)):
            a, b = self.tasks.get(task), other.tasks.get(task)
            if a is None or b is None:
                out.append(f"task {task}: {'missing in the replay' if b is None else 'not in the recording'}")
                continue
            for k in ("reports", "final", "token_ids", "logits_sha256"):
                if a.get(k) != b.get(k):
                    out.append(f"task {task} {k}: recorded {a.get(k)} vs replayed {b.get(k)}")
        return out


def digest(entries: list[bl.BusLogEntry]) -> RunDigest:
    start = next((e for e in entries if e.kind == bl.RUN_START), None)
    power = []
    for e in entries:
        if e.kind == bl.POWER_OFF and e.data.get("origin") == "trace":
            power.append(("off", e.data.get("cause")))
        elif e.kind == bl.WARNING:
            power.append(("warning", e.data.get("cause"), e.data.get("lead_trace_s")))
    commands: dict[tuple, str] = {}
    tasks: dict[str, dict] = {}
    for e in entries:
        d = e.data
        req = d.get("request")
        key = (req.get("source"), req.get("seq"), d.get("type")) if isinstance(req, dict) else None
        if e.kind == bl.COMMAND_REJECTED and key:
            commands[key] = f"rejected by the bus: {d.get('code')}"
        if e.kind != bl.PAYLOAD_REPORT:
            continue
        kind = d.get("type")
        if kind in ("ACCEPTED", "REJECTED") and isinstance(req, dict):
            cmd = (req.get("source"), req.get("seq"), req.get("type"))
            commands.setdefault(cmd, "accepted" if kind == "ACCEPTED" else f"rejected: {d.get('code')}")
        task_id = d.get("task_id")
        if not task_id or kind == "EVENT":
            continue
        t = tasks.setdefault(task_id, {"reports": set()})
        if kind in ("ACCEPTED", "STARTED", "COMPLETED", "FAILED") and (
                not isinstance(req, dict) or req.get("type") == 0x0110):
            t["reports"].add(kind)
            if kind in ("COMPLETED", "FAILED"):
                t["final"] = kind if kind == "COMPLETED" else f"FAILED {d.get('code')}"
        if kind == "TASK_RESULT" and "token_ids" in d:
            t["token_ids"], t["logits_sha256"] = d["token_ids"], d["logits_sha256"]
    for t in tasks.values():
        t["reports"] = sorted(t["reports"])
    return RunDigest(power, commands, tasks, start.data.get("model") if start else None,
                     start.data.get("machine") if start else None)


@dataclass
class ReplayReport:
    log: str
    replay_dir: str
    differences: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands_sent: int = 0

    @property
    def passed(self) -> bool:
        return not self.differences


def replay(log_path: str, out_dir: str, model: str | None = None, say=print, settle_s: float = 5.0) -> ReplayReport:
    from hil.bus import BusConfig, BusProcess, machine_fingerprint

    entries = bl.read_log(log_path)
    runs = bl.runs(entries)
    if not runs:
        raise ValueError(f"{log_path}: no bus run in this log")
    run_id, recorded = next(iter(runs.items()))
    start = next(e for e in recorded if e.kind == bl.RUN_START)
    stop = next((e for e in recorded if e.kind == bl.RUN_STOP), recorded[-1])
    commands = [e for e in recorded if e.kind == bl.COMMAND_RECEIVED and e.data.get("packet")]
    if not commands:
        raise ValueError(f"{log_path}: the run recorded no command packets (was it run with --no-log-packets?)")
    expected = digest(recorded)
    report = ReplayReport(str(log_path), str(out_dir))
    if len(runs) > 1:
        report.notes.append(f"the log holds {len(runs)} runs; replaying the first ({run_id})")
    model = model or start.data.get("model")
    if not model or not Path(model).exists():
        raise ValueError(f"model {model!r} of the recording is not here; pass --model")
    here = machine_fingerprint()
    compare_bits = expected.machine in (None, here)
    if not compare_bits:
        report.notes.append(f"recorded on {expected.machine}, replayed on {here}: answers are compared for "
                            "completion only, not bit for bit")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = str(out / "keys")
    layout = init_keys(keys)
    d = start.data
    trace_path = _trace_of(d, report)
    cfg = BusConfig(trace=trace_path, data_dir=str(out / "bus"), keys_dir=keys, time_scale=d["time_scale"],
                    start_at_s=d.get("start_at_s", 0.0), stop_at_end=d.get("stop_at_end", False),
                    endpoints=Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
                    model=model, flight_args=list(d.get("flight_args") or []),
                    heartbeat_timeout_s=d.get("heartbeat_timeout_s", 10.0), boot_timeout_s=d.get("boot_timeout_s", 60.0),
                    fdir_off_s=d.get("fdir_off_s", 2.0), boot_trace_s=d.get("boot_trace_s"))
    say(f"[replay] {len(commands)} telecommands over {stop.wall_s:.0f} s on trace {d['trace']} "
        f"(scale {d['time_scale']:g})")
    bus = BusProcess(cfg).start()
    ctx = zmq.Context()
    sock = client_socket(ctx, zmq.DEALER, layout, "ground", bus.endpoints.commands, handshake_timeout_s=30)
    t0 = time.monotonic()
    try:
        for e in commands:
            wait = e.wall_s - (time.monotonic() - t0)
            while wait > 0:  # keep the DEALER drained while waiting (answers are read, not used)
                recv_packet(sock, timeout_s=min(wait, 0.2))
                wait = e.wall_s - (time.monotonic() - t0)
            send_packet(sock, base64.b64decode(e.data["packet"]), timeout_s=10)
            report.commands_sent += 1
        end = t0 + stop.wall_s + settle_s
        while time.monotonic() < end:
            recv_packet(sock, timeout_s=0.2)
    finally:
        sock.close(linger=0)
        ctx.term()
        bus.stop()
    replayed = digest(bl.read_log(out / "bus" / bl.LOG_FILE))
    if not compare_bits:
        for t in list(expected.tasks.values()) + list(replayed.tasks.values()):
            t.pop("token_ids", None)
            t.pop("logits_sha256", None)
    report.differences += expected.differences(replayed)
    (out / "replay-report.json").write_text(json.dumps({"log": report.log, "passed": report.passed,
                                                        "differences": report.differences, "notes": report.notes,
                                                        "commands_sent": report.commands_sent}, indent=2))
    return report


def _trace_of(run_start: dict, report: ReplayReport) -> str:
    """The recorded trace file, or the shipped trace of the same name (a log recorded on another
    machine), provided its content is the recorded one."""
    import hashlib

    import traces

    path = run_start.get("trace_path")
    if not path or not Path(path).is_file():
        try:
            path = str(traces.resolve(run_start["trace"]))
        except FileNotFoundError:
            raise ValueError(f"trace {run_start.get('trace')!r} of the recording is not here") from None
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if run_start.get("trace_sha256") not in (None, digest):
        report.differences.append(f"trace {path} differs from the recorded one (sha256 {digest[:12]}... vs "
                                  f"{run_start['trace_sha256'][:12]}...)")
    return path
