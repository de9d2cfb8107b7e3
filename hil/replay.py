"""Telemetry replay: re-drive a recorded bus run against the current build and compare.

Every bus run leaves a run log (docs/bus.md §7). `replay(log)` starts a fresh bus and payload on
the same trace and time scale (so the same cuts), re-sends every recorded telecommand -- the same
packet bytes -- at the same point of the run, lets the run play out, and compares what matters,
robustly against timing jitter:

    power      the cut timeline driven by the trace (kind, cause, warning leads)
    commands   for each telecommand, how it ended: accepted, or rejected with which code
    tasks      for each task, which reports it got (accepted, started, completed or failed) and
               its answer: token ids and logits hash, bit for bit

Any difference is a divergence. Interleavings that legitimately vary from run to run (how many
PROGRESS reports, the exact unit a cut lands in) are not compared.

Re-timed to this machine (docs/hil.md "Replay"): a recording made where the payload boots in 2 s
cannot simply be played at the same wall instants where it boots in 6 s -- its cuts would land
before the work they interrupted had even started. The replay therefore follows the recording's
*anchors*, the points where the recorded payload showed where it was: connecting after each
power-up, and starting or finishing a task. Between anchors the trace runs at its own speed;
when the recorded trace time of the next anchor comes and the payload here has not reached it
yet (a slower boot, a slower model load), the bus clock is held until it does; when it gets
there early, the clock jumps forward to the recorded time. Telecommands go out at their recorded
trace times on that clock. So each cut lands the same trace time after the last anchor as in the
recording, whatever the boot costs here, and the trace and the answers still decide the result.
"""

from __future__ import annotations

import base64
import hashlib
import json
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

import traces
from common.wire import NodeId
from common.wire import messages as m
from common.wire.link import (
    DEFAULT_CLIENTS,
    Endpoints,
    bind_station,
    client_socket,
    init_keys,
    recv_packet,
    send_packet,
    station_source_id,
)
from hil.bus import BusConfig, BusThread, default_payload_command
from hil.bus import buslog as bl

#: The recording's limits (run_start `limits`) a replay runs with.
_REPLAYED_LIMITS = (
    "max_in_flight",
    "station_quota",
    "station_rate",
    "station_burst",
    "store_max_commands",
    "store_max_bytes",
    "throttle_event_s",
)


@dataclass
class RunDigest:
    """The comparable essence of one recorded run."""

    power: list[tuple]
    commands: dict[tuple, str]
    tasks: dict[str, dict]
    model: str | None = None
    machine: dict | None = None

    def differences(self, other: RunDigest, compare_logits: bool = True) -> list[str]:
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
            recorded, replayed = self.tasks.get(task), other.tasks.get(task)
            if recorded is None or replayed is None:
                out.append(f"task {task}: {'missing in the replay' if replayed is None else 'not in the recording'}")
                continue
            for k in ("reports", "final", "token_ids", "logits_sha256")[: 4 if compare_logits else 3]:
                if recorded.get(k) != replayed.get(k):
                    out.append(f"task {task} {k}: recorded {recorded.get(k)} vs replayed {replayed.get(k)}")
        return out


def digest(entries: list[bl.BusLogEntry]) -> RunDigest:
    start = next((e for e in entries if e.kind == bl.RUN_START), None)
    power: list[tuple] = []
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
            not isinstance(req, dict) or req.get("type") == 0x0110
        ):
            t["reports"].add(kind)
            if kind in ("COMPLETED", "FAILED"):
                t["final"] = kind if kind == "COMPLETED" else f"FAILED {d.get('code')}"
        if kind == "TASK_RESULT" and "token_ids" in d:
            t["token_ids"], t["logits_sha256"] = d["token_ids"], d["logits_sha256"]
    for t in tasks.values():
        t["reports"] = sorted(t["reports"])
    return RunDigest(
        power, commands, tasks, start.data.get("model") if start else None, start.data.get("machine") if start else None
    )


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


@dataclass(frozen=True)
class Anchor:
    """A point where the recorded payload showed where it was: `kind` ("connected", "STARTED",
    "COMPLETED", "FAILED") of `task_id` in power cycle `cycle`, at recorded trace time `trace_s`."""

    cycle: int
    trace_s: float
    kind: str
    task_id: str | None = None


def anchors_of(entries: list[bl.BusLogEntry]) -> list[Anchor]:
    out, cycle = [], 0
    for e in entries:
        if e.kind == bl.POWER_ON:
            cycle = int(e.data.get("power_cycle") or cycle + 1)
        elif e.kind == bl.PAYLOAD_CONNECTED and cycle:
            out.append(Anchor(cycle, e.stamped_trace_s, "connected"))
        elif (
            e.kind == bl.PAYLOAD_REPORT
            and cycle
            and e.data.get("type") in ("STARTED", "COMPLETED", "FAILED")
            and isinstance(e.data.get("request"), dict)
            and e.data["request"].get("type") == "UPLINK_TASK"
        ):
            out.append(Anchor(cycle, e.stamped_trace_s, e.data["type"], e.data.get("task_id")))
    return out


class AnchorPacer:
    """Runs in the bus's thread (Bus(pacer=...)): holds the bus clock at each recorded anchor
    until the payload here reaches it, or moves the clock forward to it when the payload gets
    there first. An anchor not reached within `hold_limit_s` of wall time is given up (the run
    diverges; the comparison will say where)."""

    def __init__(self, anchors: list[Anchor], hold_limit_s: float = 600.0):
        self.pending = deque(anchors)
        self.hold_limit_s = hold_limit_s
        self.seen: set[tuple] = set()
        self.held_since: float | None = None
        self.held_total_s = 0.0
        self.jumped_total_s = 0.0
        self.notes: list[str] = []
        self.lock = threading.Lock()
        self._connected_cycle = 0

    @property
    def done(self) -> bool:
        return not self.pending

    def payload_message(self, bus, message, now: float) -> None:
        if isinstance(message, (m.Started, m.Completed, m.Failed)) and message.tc_type == 0x0110:
            self.seen.add((bus.power_count, message.TYPE.name, message.task_id))

    def step(self, bus, now: float) -> None:
        if bus.payload_rid is not None and bus.power_count != self._connected_cycle:
            self._connected_cycle = bus.power_count
            self.seen.add((bus.power_count, "connected", None))
        clock = bus.clock
        while self.pending:
            anchor = self.pending[0]
            if anchor.cycle < bus.power_count:
                self._give_up(bus, now, f"{anchor} not reached before power cycle {bus.power_count}")
                continue
            if (anchor.cycle, anchor.kind, anchor.task_id) in self.seen:
                self.seen.discard((anchor.cycle, anchor.kind, anchor.task_id))
                self.pending.popleft()
                if self.held_since is not None:
                    self.held_total_s += now - self.held_since
                    self.held_since = None
                    clock.release(now)
                elif anchor.cycle == bus.power_count and clock.trace_s(now) < anchor.trace_s:
                    ahead = (anchor.trace_s - clock.trace_s(now)) * clock.scale
                    clock.t0 -= ahead  # got there early: on to the recorded time
                    self.jumped_total_s += ahead
                continue
            if anchor.cycle == bus.power_count and clock.held_at is None and clock.trace_s(now) >= anchor.trace_s:
                clock.hold(min(now, clock.at(anchor.trace_s)))
                self.held_since = now
            if self.held_since is not None and now - self.held_since > self.hold_limit_s:
                self._give_up(bus, now, f"{anchor} not reached within {self.hold_limit_s:g} s")
                continue
            return

    def _give_up(self, bus, now: float, why: str) -> None:
        self.pending.popleft()
        self.notes.append(f"anchor given up: {why}")
        if self.held_since is not None:
            self.held_total_s += now - self.held_since
            self.held_since = None
            bus.clock.release(now)


def replay(
    log_path: str,
    out_dir: str,
    model: str | None = None,
    say=print,
    settle_s: float = 5.0,
    payload_start_delay_s: float = 0.0,
    timeout_s: float = 900.0,
) -> ReplayReport:
    """Replay the first run of `log_path` against this build (see the module doc).
    `payload_start_delay_s` delays every start of the payload process (tests: a slower boot
    than the recording's must not change the outcome)."""

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

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = str(out / "keys")
    # One key per recorded source id, bound to it: the bus takes a source id only from its key.
    sources = sorted({int(e.data["request"]["source"]) for e in commands}) or [int(NodeId.GROUND)]
    station_of = {source: "ground" if source == NodeId.GROUND else f"replay-{source:04x}" for source in sources}
    layout = init_keys(keys, clients=(*DEFAULT_CLIENTS, *station_of.values()))
    for source, name in station_of.items():
        if station_source_id(layout, name) != source:
            bind_station(layout, name, source)
    d = start.data
    trace_path = _trace_of(d, report)
    command = None
    if payload_start_delay_s > 0:
        command = ["sh", "-c", f'sleep {payload_start_delay_s:.3f}; exec "$@"', "sh", *default_payload_command()]
    # The boot and heartbeat allowances scale with whatever this machine's boot costs: a replay
    # must not power-cycle a payload the recording would have waited for.
    cfg = BusConfig(
        trace=trace_path,
        data_dir=str(out / "bus"),
        keys_dir=keys,
        time_scale=d["time_scale"],
        start_at_s=d.get("start_at_s", 0.0),
        stop_at_end=d.get("stop_at_end", False),
        endpoints=Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        model=model,
        flight_args=list(d.get("flight_args") or []),
        payload_command=command,
        heartbeat_timeout_s=d.get("heartbeat_timeout_s", 10.0),
        boot_timeout_s=max(d.get("boot_timeout_s", 60.0), 60.0 + payload_start_delay_s),
        fdir_off_s=d.get("fdir_off_s", 2.0),
        boot_loop_limit=d.get("boot_loop_limit", 5),
        boot_loop_backoff_s=d.get("boot_loop_backoff_s", 60.0),
        boot_settle_s=d.get("boot_settle_s", 10.0),
        boot_trace_s=d.get("boot_trace_s"),
        # The recording's limits: a flood is refused the same way again.
        **{k: v for k, v in (d.get("limits") or {}).items() if k in _REPLAYED_LIMITS},
    )
    say(
        f"[replay] {len(commands)} telecommands over {stop.wall_s:.0f} s on trace {d['trace']} "
        f"(scale {d['time_scale']:g}), re-timed at {len(anchors_of(recorded))} anchors"
    )
    pacer = AnchorPacer(anchors_of(recorded))
    bus = BusThread(cfg, pacer=pacer).start()
    ctx = zmq.Context()
    socks = {
        source: client_socket(ctx, zmq.DEALER, layout, name, bus.endpoints.commands, handshake_timeout_s=30)
        for source, name in station_of.items()
    }

    def drain(timeout_s: float) -> None:  # keep the DEALERs drained (answers are read, not used)
        for i, sock in enumerate(socks.values()):
            recv_packet(sock, timeout_s=timeout_s if i == 0 else 0)

    clock = bus.bus.clock
    deadline = time.monotonic() + timeout_s
    end_trace = stop.trace_s if stop.trace_s is not None else d.get("start_at_s", 0.0) + stop.wall_s
    try:
        for e in commands:
            while clock.trace_s() < e.stamped_trace_s and time.monotonic() < deadline:
                drain(0.05)
            send_packet(socks[int(e.data["request"]["source"])], base64.b64decode(e.data["packet"]), timeout_s=10)
            report.commands_sent += 1
        while (
            clock.trace_s() < end_trace + settle_s / max(d["time_scale"], 1e-9) or not pacer.done
        ) and time.monotonic() < deadline:
            drain(0.2)
    finally:
        for sock in socks.values():
            sock.close(linger=0)
        ctx.term()
        bus.stop()
    report.notes.append(
        f"clock held {pacer.held_total_s:.1f} s and moved forward {pacer.jumped_total_s:.1f} s to "
        "follow the recording's anchors"
    )
    report.notes += pacer.notes
    if time.monotonic() >= deadline:
        report.differences.append(f"the replay did not reach the recording's end within {timeout_s:g} s")
    replayed = digest(bl.read_log(out / "bus" / bl.LOG_FILE))
    references = local_references(model, commands, list(d.get("flight_args") or []), report)
    same_bits = not references or all(
        expected.tasks.get(t, {}).get("logits_sha256") in (None, h) for t, h in references.items()
    )
    report.differences += expected.differences(replayed, compare_logits=same_bits)
    if not same_bits:
        # This machine's kernels give other bits than the recording's (a CPU of the same name can
        # take other vector paths): every answer must then equal *this machine's* uninterrupted
        # answer bit for bit -- the product's guarantee -- and the recording's token ids.
        report.notes.append(
            "this machine computes other logits bits than the recording's machine: answers are "
            "compared bit for bit against uninterrupted runs here, token ids against the recording"
        )
        for task, want in sorted(references.items()):
            got = replayed.tasks.get(task, {}).get("logits_sha256")
            if got is not None and got != want:
                report.differences.append(f"task {task} logits_sha256: replayed {got} vs uninterrupted here {want}")
    (out / "replay-report.json").write_text(
        json.dumps(
            {
                "log": report.log,
                "passed": report.passed,
                "differences": report.differences,
                "notes": report.notes,
                "commands_sent": report.commands_sent,
            },
            indent=2,
        )
    )
    return report


def local_references(
    model: str, commands: list[bl.BusLogEntry], flight_args: list[str], report: ReplayReport
) -> dict[str, str]:
    """Logits hash of each recorded task run uninterrupted here, in this process: its images
    re-assembled from the recorded IMAGE_CHUNK packets and decoded as the payload decodes them,
    the engine geometry from the recorded flight arguments."""

    tasks, images = bl.recorded_uplinks(commands)
    option = {a: flight_args[i + 1] for i, a in enumerate(flight_args[:-1]) if a.startswith("--")}
    try:
        # lazy: torch/transformers (seconds to import), only when a replay recomputes the answer
        from flight.checkpoint.policies import Geometry
        from flight.engine import Engine, EngineOptions
        from flight.model.inputs import build_inputs, decode_image
        from flight.model.loader import load_model

        loaded = load_model(model, device="cpu")
        geometry = Geometry(
            int(option.get("--chunk", 1024)),
            int(option.get("--group", 4)),
            int(option.get("--decode-every", 16)),
            int(option.get("--vision-every", 4)),
        )
        threads = int(option["--threads"]) if "--threads" in option else None
        out = {}
        for task in tasks.values():
            pictures = [decode_image(images[name], name, loaded.image_processor) for name in task.images]
            inputs = build_inputs(
                loaded.tokenizer, loaded.image_processor, pictures, task.prompt, loaded.adapter.image_token_id
            )
            with tempfile.TemporaryDirectory() as scratch:
                result = Engine(loaded, EngineOptions(geometry=geometry, policy="none", threads=threads)).run(
                    inputs, scratch, task.max_new_tokens
                )
            out[task.task_id] = result.logits_sha256()
        return out
    except Exception as exc:  # noqa: BLE001 - without references the recording's bits are the only yardstick
        report.notes.append(
            f"no uninterrupted references here ({type(exc).__name__}: {exc}); logits compared with the recording's"
        )
        return {}


def _trace_of(run_start: Mapping[str, Any], report: ReplayReport) -> str:
    """The recorded trace file, or the shipped trace of the same name (a log recorded on another
    machine), provided its content is the recorded one."""

    path = run_start.get("trace_path")
    if not path or not Path(path).is_file():
        try:
            path = str(traces.resolve(run_start["trace"]))
        except FileNotFoundError:
            raise ValueError(f"trace {run_start.get('trace')!r} of the recording is not here") from None
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    if run_start.get("trace_sha256") not in (None, digest):
        report.differences.append(
            f"trace {path} differs from the recorded one (sha256 {digest[:12]}... vs "
            f"{run_start['trace_sha256'][:12]}...)"
        )
    return path
