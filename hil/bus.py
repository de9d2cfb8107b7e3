"""The mock spacecraft bus (docs/bus.md).

It owns the payload's power switch and replays an interruption trace against it: it powers the
payload up at each `power_on`, warns it before announced cuts, cuts it (SIGKILL) at each `cut`;
it publishes power / thermal / FDIR telemetry; it relays ground telecommands to the payload and
the payload's reports back, storing commands durably while the payload is off; and it power-
cycles a payload whose heartbeat stops (FDIR). Every run appends a run log (hil.buslog).

    from hil.bus import Bus, BusConfig
    bus = Bus(BusConfig(trace="trace-a", data_dir=..., keys_dir=..., time_scale=0.01, model=...))
    bus.start()           # binds the three sockets; bus.endpoints tells where
    bus.run()             # until request_stop() / SIGTERM, or the trace end with stop_at_end

`BusThread` runs one in a background thread, `BusProcess` as a child process (`ow bus run`).

Clock: `time_scale` is wall seconds per trace second. Trace second t happens at wall time
(t - start_at) × time_scale after start; the bus clock carried in telemetry (`trace_time_s`,
`lead_time_s`) is trace time × time_scale, so it runs at wall speed and a lead tells the payload
how many of its own seconds it has left.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import zmq

import traces
from common import log, machine
from common.wire import (
    Apid,
    DurableSequenceCounter,
    FdirMode,
    MessageType,
    NodeId,
    PowerCause,
    ResponseCode,
    WireError,
    decode,
    encode,
)
from common.wire import messages as m
from common.wire.errors import RequestRef
from common.wire.ids import MAX_EVENT_TEXT_BYTES
from common.wire.link import (
    Endpoints,
    KeyLayout,
    LinkError,
    bound_endpoint,
    recv_packet,
    send_packet,
    server_socket,
    start_authenticator,
)
from common.wire.text import clip_utf8
from hil import buslog as bl
from hil.busstore import CommandStore, StoredCommand, request_key
from hil.power import CommandSwitch, LocalProcessSwitch, PowerSwitch, PowerSwitchError, SshSwitch, process_write_bytes
from traces import CutCause, EventKind

_log = log.get("hil.bus")

#: Trace cut causes (docs/trace-format.md §3.1) as wire power causes (docs/wire-protocol.md §5.5).
TRACE_CAUSE = {
    CutCause.POWER: PowerCause.LOW_BATTERY,
    CutCause.THERMAL: PowerCause.THERMAL,
    CutCause.FDIR: PowerCause.FDIR,
    CutCause.CONTENTION: PowerCause.COMMANDED,
}

#: The payload link's client name (key file stem) unless configured otherwise.
PAYLOAD_CLIENT = "payload"
#: Source ids a ground station may use (docs/wire-protocol.md §5.1).
GROUND_SOURCE_IDS = range(0x0001, 0x0100)
#: Replies that answer one telecommand, and the field that ties reply to command.
REPLY_TO = {
    MessageType.PING: (MessageType.PONG, "key"),
    MessageType.STATUS: (MessageType.HOUSEKEEPING, None),
    MessageType.DOWNLINK_RESULT: (MessageType.TASK_RESULT, "task_id"),
    MessageType.IMAGE_QUERY: (MessageType.IMAGE_STATUS, "image"),
}
#: How long an unanswered reply expectation is kept (wall seconds).
REPLY_EXPECTATION_S = 600.0
#: Routing entries kept for reports of earlier telecommands.
ROUTES_KEPT = 100_000
#: Longest the main loop sleeps in a poll, so that cuts land on time.
POLL_MAX_S = 0.02
#: skip-idle mode: how long the payload must report no task before idle time is skipped, and
#: the smallest jump worth making (wall seconds)
IDLE_CONFIRM_S = 0.5
SKIP_MIN_S = 0.05
SWITCH_RETRY_S = 1.0


def default_payload_command(python: str | None = None) -> list[str]:
    """`ow flight run ...` as the local driver spawns it (the `ow` of this interpreter)."""
    return [
        python or sys.executable,
        "-m",
        "common.cli",
        "flight",
        "run",
        "--data-dir",
        "{payload_data_dir}",
        "--model",
        "{model}",
        "--keys",
        "{keys}",
        "--payload-endpoint",
        "{payload_endpoint}",
    ]


#: The same for a remote board, where `ow` is on the PATH of the SSH login.
REMOTE_PAYLOAD_COMMAND = [
    "ow",
    "flight",
    "run",
    "--data-dir",
    "{payload_data_dir}",
    "--model",
    "{model}",
    "--keys",
    "{keys}",
    "--payload-endpoint",
    "{payload_endpoint}",
]

PLACEHOLDERS = ("python", "payload_data_dir", "bus_data_dir", "model", "keys", "payload_endpoint")


def machine_fingerprint() -> dict:
    """What decides the bits of a CPU inference: processor model, core count, library versions.
    A replay on another fingerprint cannot expect identical logits."""
    return {"cpu": machine.cpu_model(), "cpus": machine.cpu_count(), **machine.library_versions()}


class BusConfigError(ValueError):
    """The bus cannot start with this configuration."""


@dataclass
class BusConfig:
    """Everything `ow bus run` takes (docs/bus.md §8 lists the options)."""

    trace: str
    data_dir: str | os.PathLike
    keys_dir: str | os.PathLike
    #: wall seconds per trace second (0.01: the trace runs 100× faster than real time)
    time_scale: float = 1.0
    #: trace second at which the run starts
    start_at_s: float = 0.0
    #: stop the bus (and cut the payload) at the trace's end instead of keeping the payload on
    stop_at_end: bool = False
    endpoints: Endpoints = field(default_factory=Endpoints.from_env)
    #: the payload endpoint as the payload must connect to it (default: the bound one)
    payload_connect_endpoint: str | None = None
    power_driver: str = "local"
    #: argv template of the flight process; placeholders {python} {payload_data_dir} {bus_data_dir}
    #: {model} {keys} {payload_endpoint}; `flight_args` are appended
    payload_command: Sequence[str] | None = None
    model: str | None = None
    flight_args: Sequence[str] = ()
    #: payload data directory as the payload sees it (default <data_dir>/payload)
    payload_data_dir: str | None = None
    #: keys directory as the payload sees it (default keys_dir)
    payload_keys_dir: str | None = None
    # ssh driver
    ssh_host: str | None = None
    ssh_user: str | None = None
    ssh_port: int | None = None
    ssh_identity: str | None = None
    ssh_options: Sequence[str] = ()
    ssh_transport: Sequence[str] | None = None
    ssh_mode: str = "kill"
    ssh_pidfile: str = "/tmp/orbitweaver-payload.pid"
    ssh_kill_command: str | None = None
    ssh_reboot_command: str | None = None
    # command driver
    power_on_command: str | None = None
    power_off_command: str | None = None
    switch_timeout_s: float = 30.0
    # health and delivery (wall seconds)
    heartbeat_timeout_s: float = 10.0
    boot_timeout_s: float = 60.0
    heartbeat_gap_log_s: float = 3.0
    fdir_off_s: float = 2.0
    confirm_after_s: float = 2.0
    max_in_flight: int = 32
    # telemetry
    telemetry_max_hz: float = 10.0
    bus_temp_c: float = 20.0
    # links
    payload_client: str = PAYLOAD_CLIENT
    #: client names allowed on the commands link; None: every authorized client but the payload
    ground_clients: Sequence[str] | None = None
    #: keep each received telecommand's bytes (base64) in the run log, for replays
    log_packets: bool = True
    #: write the bound endpoints here (JSON) once the sockets are up
    ready_file: str | os.PathLike | None = None
    #: compressed long runs: jump the trace clock over spans where nothing can happen -- the
    #: payload off until its next power-on, or on, connected and idle (no task, no command in
    #: flight) until the next trace action -- never past a `hold_at_s` trace time (e.g. when the
    #: ground will send something)
    skip_idle: bool = False
    hold_at_s: Sequence[float] = ()
    #: emulated payload boot in trace seconds (local driver): the payload is forked from a
    #: zygote that has imported its libraries, and waits boot_trace_s x time_scale wall seconds
    #: after each power-on before it runs (the target's boot, scaled like everything else;
    #: docs/hil.md). None: exec the payload at each power-on (this machine's real start-up).
    boot_trace_s: float | None = None
    #: what the zygote imports ("module" or "module:function"); default: the flight payload's
    zygote_preload: Sequence[str] | None = None

    def validate(self) -> None:
        if isinstance(self.payload_command, str):
            self.payload_command = shlex.split(self.payload_command)
        if isinstance(self.ssh_transport, str):
            self.ssh_transport = shlex.split(self.ssh_transport)
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise BusConfigError(f"--time-scale must be > 0, got {self.time_scale}")
        if not (math.isfinite(self.start_at_s) and self.start_at_s >= 0):
            raise BusConfigError(f"--start-at must be >= 0, got {self.start_at_s}")
        if self.power_driver not in ("local", "ssh", "command"):
            raise BusConfigError(f"unknown power driver {self.power_driver!r} (local, ssh, command)")
        if self.power_driver == "command" and not (self.power_on_command and self.power_off_command):
            raise BusConfigError("--power-driver command needs --power-on-command and --power-off-command")
        if self.power_driver == "ssh" and not (self.ssh_host or self.ssh_transport):
            raise BusConfigError("--power-driver ssh needs --ssh-host")
        if self.max_in_flight < 1:
            raise BusConfigError("max_in_flight must be >= 1")
        if self.boot_trace_s is not None:
            if not (math.isfinite(self.boot_trace_s) and self.boot_trace_s >= 0):
                raise BusConfigError(f"--boot-trace-s must be >= 0, got {self.boot_trace_s}")
            if self.power_driver != "local":
                raise BusConfigError(
                    "--boot-trace-s (emulated boot) needs --power-driver local; a real board boots in real time"
                )
        for name in ("heartbeat_timeout_s", "boot_timeout_s", "fdir_off_s", "confirm_after_s"):
            if getattr(self, name) < 0:
                raise BusConfigError(f"{name} must be >= 0")


class TraceClock:
    """Trace time against the monotonic clock: trace second t is at t0 + (t - start_at) × scale.

    `hold` stops trace time (a replay waiting for the payload to reach the point the recording
    had reached by then, hil/replay.py); `release` lets it run on from where it stopped."""

    def __init__(self, time_scale: float, start_at_s: float, t0: float | None = None):
        self.scale = float(time_scale)
        self.start_at_s = float(start_at_s)
        self.t0 = time.monotonic() if t0 is None else t0
        self.held_at: float | None = None

    def hold(self, now: float) -> None:
        if self.held_at is None:
            self.held_at = now

    def release(self, now: float) -> None:
        if self.held_at is not None:
            self.t0 += now - self.held_at
            self.held_at = None

    def trace_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self.held_at is not None:
            now = min(now, self.held_at)
        return self.start_at_s + (now - self.t0) / self.scale

    def clock_s(self, now: float | None = None) -> float:
        """The bus clock of telemetry: trace time × scale (wall speed)."""
        return self.trace_s(now) * self.scale

    def at(self, trace_s: float) -> float:
        """Monotonic time at which trace second `trace_s` happens (never, while held past it)."""
        t = self.t0 + (trace_s - self.start_at_s) * self.scale
        return math.inf if self.held_at is not None and t > self.held_at else t


@dataclass(frozen=True)
class _Action:
    trace_s: float
    order: int  # at equal times: cut, then power_on, then warning (the trace's own order)
    kind: str  # "power_on", "warning", "cut", "end"
    cause: CutCause | None = None
    lead_s: float = 0.0


def trace_actions(
    trace: traces.Trace, start_at_s: float
) -> tuple[bool, tuple[float, CutCause, float] | None, list[_Action]]:
    """(on at the start, warning in force at the start as (cut time, cause, lead) or None, the
    actions after the start in time order, ending with "end")."""
    on = trace.is_on_at(start_at_s)
    pending = None
    for window in trace.windows():
        w = window.warning_at_s
        if w is not None and w < start_at_s < window.end_s and window.start_s <= start_at_s:
            pending = (window.end_s, window.cut_cause, window.warning_lead_s)
    actions = []
    for index, event in enumerate(trace.events):
        if event.kind is EventKind.WARNING:
            if event.t_s >= start_at_s:
                actions.append(_Action(event.t_s, index, "warning", event.cause, event.lead_s))
        elif event.t_s > start_at_s:
            kind = "power_on" if event.kind is EventKind.POWER_ON else "cut"
            actions.append(_Action(event.t_s, index, kind, event.cause, event.lead_s))
    actions.sort(key=lambda a: (a.trace_s, a.order))
    actions.append(_Action(max(trace.duration_s, start_at_s), len(trace.events), "end"))
    return on, pending, actions


def expand_command(template: Sequence[str], values: dict[str, str | None], extra: Sequence[str] = ()) -> list[str]:
    """Fill the placeholders of a command template. A `{flight_args}` token takes the extra
    arguments in its place; otherwise they are appended."""
    out: list[str] = []
    placed = False
    for token in template:
        if token == "{flight_args}":
            out.extend(extra)
            placed = True
            continue
        for name in PLACEHOLDERS:
            if "{" + name + "}" in token and values.get(name) is None:
                raise BusConfigError(
                    f"payload command uses {{{name}}} but no value was given (--{name.replace('_', '-')})"
                )
        try:
            out.append(token.format_map({k: v for k, v in values.items() if v is not None}))
        except (KeyError, IndexError, ValueError) as exc:
            raise BusConfigError(f"payload command token {token!r}: unknown placeholder {exc}") from None
    if not placed:
        out.extend(extra)
    return out


def _request_dict(request: RequestRef) -> dict:
    try:
        type_name = MessageType(request.message_type).name
    except ValueError:
        type_name = f"{request.message_type:#06x}"
    return {"apid": request.apid, "source": request.source_id, "seq": request.seq, "type": type_name}


@dataclass
class _Expectation:
    reply: MessageType
    field_name: str | None
    value: Any
    key: tuple[int, int, int, int]
    source_id: int
    created: float
    #: the command has been sent to the payload: an answer can only come after that
    armed: bool = False


class Bus:
    """The mock spacecraft bus. Not thread-safe: one thread calls start() and run(); any thread
    may call request_stop()."""

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer=None):
        config.validate()
        self.config = config
        #: replays only: an object whose `step(bus, now)` runs every loop and whose
        #: `payload_message(bus, message, now)` sees every payload packet; it may hold the clock
        self.pacer = pacer
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.layout = KeyLayout(Path(config.keys_dir))
        if not self.layout.server_secret.exists():
            raise BusConfigError(f"no bus key pair in {self.layout.server_dir} (run `ow ground keys init`)")
        try:
            self.trace = traces.load(config.trace)
        except (ValueError, OSError) as exc:  # TraceError is a ValueError
            raise BusConfigError(f"trace {config.trace}: {exc}") from None
        if config.start_at_s > self.trace.duration_s:
            raise BusConfigError(f"--start-at {config.start_at_s} is after the trace's end ({self.trace.duration_s} s)")
        self._switch_override = switch
        if switch is None:
            self.payload_argv(payload_endpoint="tcp://127.0.0.1:0")  # placeholders check out before binding
        self.switch: PowerSwitch | None = None
        self.endpoints: Endpoints | None = None
        self.payload_connect_endpoint: str | None = None
        self._stop = threading.Event()
        self.stop_reason = "requested"
        self._started = False
        self._ctx: zmq.Context | None = None
        self._auth = None
        self.ready = threading.Event()

    # ------------------------------------------------------------------ set-up
    def start(self) -> Endpoints:
        """Bind the sockets and open the store and the run log. Returns the bound endpoints."""
        cfg = self.config
        self._lock_data_dir()
        try:
            self.store = CommandStore(self.data_dir / "bus-store")
            self.tm_counter = DurableSequenceCounter(self.data_dir / "state" / "bus-tm-sequence.bin", reserve=1024)
            self._ctx = zmq.Context()
            self._auth = start_authenticator(self._ctx, self.layout)
            self.commands = server_socket(self._ctx, zmq.ROUTER, self.layout, cfg.endpoints.commands)
            self.payload_sock = server_socket(self._ctx, zmq.ROUTER, self.layout, cfg.endpoints.payload)
            self.telemetry = server_socket(self._ctx, zmq.PUB, self.layout, cfg.endpoints.telemetry)
            self.endpoints = Endpoints(
                commands=bound_endpoint(self.commands),
                payload=bound_endpoint(self.payload_sock),
                telemetry=bound_endpoint(self.telemetry),
            )
            self.payload_connect_endpoint = cfg.payload_connect_endpoint or self.endpoints.payload
            self._open(cfg)
        except BaseException:
            if getattr(self, "buslog", None) is not None:
                self.buslog.close()
            self._close_sockets()
            raise
        self._started = True
        self.ready.set()
        return self.endpoints

    def _open(self, cfg: BusConfig) -> None:
        self.switch = self._switch_override or self._build_switch()
        self.buslog = bl.BusLog(self.data_dir / bl.LOG_FILE)
        self._init_state()
        self.buslog.write(
            bl.RUN_START,
            trace_s=self.clock.start_at_s,
            clock_s=self.clock.clock_s(self.clock.t0),
            wall_s=0.0,
            format=bl.LOG_FORMAT,
            version=bl.LOG_VERSION,
            trace=self.trace.name,
            trace_path=str(traces.resolve(cfg.trace)),
            trace_sha256=self._trace_digest(),
            trace_duration_s=self.trace.duration_s,
            time_scale=cfg.time_scale,
            start_at_s=cfg.start_at_s,
            stop_at_end=cfg.stop_at_end,
            endpoints={
                "commands": self.endpoints.commands,
                "payload": self.endpoints.payload,
                "telemetry": self.endpoints.telemetry,
                "payload_connect": self.payload_connect_endpoint,
            },
            switch=self.switch.describe(),
            heartbeat_timeout_s=cfg.heartbeat_timeout_s,
            boot_timeout_s=cfg.boot_timeout_s,
            fdir_off_s=cfg.fdir_off_s,
            stored_commands=len(self.store),
            bus_pid=os.getpid(),
            model=cfg.model,
            flight_args=list(cfg.flight_args),
            machine=machine_fingerprint(),
            boot_trace_s=cfg.boot_trace_s,
            skip_idle=cfg.skip_idle,
        )
        _log.info(
            "bus_started",
            trace=self.trace.name,
            time_scale=cfg.time_scale,
            start_at_s=cfg.start_at_s,
            commands=self.endpoints.commands,
            payload=self.endpoints.payload,
            telemetry=self.endpoints.telemetry,
            stored_commands=len(self.store),
            driver=self.switch.driver,
        )
        try:
            self.switch.reset()
        except PowerSwitchError as exc:
            self._switch_failed("reset", exc)

    def _lock_data_dir(self) -> None:
        """One bus per data directory: two would share a queue and power two payloads."""
        self._lock_fd = os.open(self.data_dir / "bus.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise BusConfigError(f"another bus is running on {self.data_dir}") from None

    def _trace_digest(self) -> str:
        try:
            return hashlib.sha256(traces.resolve(self.config.trace).read_bytes()).hexdigest()
        except (OSError, ValueError, traces.TraceError):
            return ""

    def _write_ready(self, path: Path) -> None:
        info = {
            "commands": self.endpoints.commands,
            "payload": self.endpoints.payload,
            "telemetry": self.endpoints.telemetry,
            "payload_connect": self.payload_connect_endpoint,
            "pid": os.getpid(),
            "log": str(self.buslog.path),
            "run": self.buslog.run,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)

    def payload_argv(self, template: Sequence[str] | None = None, payload_endpoint: str | None = None) -> list[str]:
        """The flight process's command line (for the ssh driver: the remote one)."""
        cfg = self.config
        values = {
            "python": sys.executable,
            "payload_data_dir": cfg.payload_data_dir or str(self.data_dir / "payload"),
            "bus_data_dir": str(self.data_dir),
            "model": cfg.model,
            "keys": cfg.payload_keys_dir or str(cfg.keys_dir),
            "payload_endpoint": payload_endpoint or self.payload_connect_endpoint,
        }
        if template is None:
            template = cfg.payload_command or (
                REMOTE_PAYLOAD_COMMAND if cfg.power_driver == "ssh" else default_payload_command()
            )
        return expand_command(template, values, cfg.flight_args)

    def _build_switch(self) -> PowerSwitch:
        cfg = self.config
        if cfg.power_driver == "local":
            zygote, boot_s = None, 0.0
            if cfg.boot_trace_s is not None:
                from hil.zygote import FLIGHT_PRELOAD, Zygote

                zygote = Zygote(cfg.zygote_preload or FLIGHT_PRELOAD, log_path=self.data_dir / "zygote.log").start()
                boot_s = cfg.boot_trace_s * cfg.time_scale
            return LocalProcessSwitch(
                self.payload_argv(),
                output_path=self.data_dir / "payload.log",
                pidfile=self.data_dir / "payload.pid",
                zygote=zygote,
                boot_s=boot_s,
            )
        if cfg.power_driver == "ssh":
            kwargs = {}
            if cfg.ssh_reboot_command:
                kwargs["reboot_command"] = cfg.ssh_reboot_command
            return SshSwitch(
                shlex.join(self.payload_argv()),
                host=cfg.ssh_host,
                user=cfg.ssh_user,
                port=cfg.ssh_port,
                identity=cfg.ssh_identity,
                ssh_options=cfg.ssh_options,
                transport=cfg.ssh_transport,
                mode=cfg.ssh_mode,
                pidfile=cfg.ssh_pidfile,
                kill_command=cfg.ssh_kill_command,
                output_path=self.data_dir / "payload.log",
                timeout_s=cfg.switch_timeout_s,
                **kwargs,
            )
        return CommandSwitch(cfg.power_on_command, cfg.power_off_command, timeout_s=cfg.switch_timeout_s)

    def _init_state(self) -> None:
        self.payload_idle_since: float | None = None
        self.payload_queue_depth: int | None = None
        cfg = self.config
        self.clock = TraceClock(cfg.time_scale, cfg.start_at_s, self.buslog.started_monotonic)
        self.trace_on, self.pending_warning, actions = trace_actions(self.trace, cfg.start_at_s)
        self.actions = deque(actions)
        self.trace_ended = False
        self.off_cause = PowerCause.TRACE
        self.off_origin = "trace"
        self.fdir_hold_until = 0.0
        self.next_switch_attempt = 0.0
        # payload link
        self.link_id = 0
        self.payload_rid: bytes | None = None
        self.powered_at: float | None = None
        self.last_seen: float | None = None
        self.gap_reported = False
        self.power_count = 0
        #: whether the payload's last power-off was FDIR's answer to a payload failure (told to the
        #: next boot: its health and safety counts only such exits against what it was handling)
        self.last_off_fault = False
        # FDIR telemetry channels
        self.fdir_mode = FdirMode.NOMINAL
        self.fault_count = 0
        self.last_fault: str | None = None
        # routing of reports back to the ground connection that sent the telecommand
        self.route_by_request: dict[tuple, bytes] = {}
        self.route_by_source: dict[int, bytes] = {}
        self.task_owner: dict[str, tuple] = {}
        self.expectations: list[_Expectation] = []
        # telemetry decimation: one report per `tm_step` trace seconds
        period = self.trace.telemetry_period_s or 1.0
        min_wall = 1.0 / cfg.telemetry_max_hz
        self.tm_step = period * max(1, math.ceil(min_wall / (period * cfg.time_scale) - 1e-9))
        self.next_tm_trace = math.ceil(cfg.start_at_s / self.tm_step - 1e-9) * self.tm_step
        self.next_tm_after_end = 0.0
        self.last_sample = self.trace.telemetry_at(cfg.start_at_s)
        # Commands stored by an earlier run: their answers go to the station's new connection.
        for entry in self.store.pending():
            self._expect_replies(entry.request, decode(entry.packet)[1])

    # ------------------------------------------------------------------ main loop
    def request_stop(self, reason: str = "requested") -> None:
        self.stop_reason = reason
        self._stop.set()

    def run(self) -> int:
        """Run until request_stop() (or the trace end with stop_at_end). Returns 0."""
        if not self._started:
            self.start()
        try:
            self.switch.prepare()  # a zygote imports the payload's libraries before time starts
        except PowerSwitchError as exc:
            self._switch_failed("prepare", exc)
            self._shutdown()
            raise
        # The ready file says "commands can come": only once the switch can power the payload, so
        # that a bus which cannot (a zygote that failed) is seen as one that never started.
        if self.config.ready_file:
            self._write_ready(Path(self.config.ready_file))
        # Trace time starts now, not when the sockets were bound.
        self.clock.t0 = self.buslog.restart_clock()
        try:
            while not self._stop.is_set():
                self._step()
        except BaseException as exc:
            self.stop_reason = f"error: {type(exc).__name__}: {exc}"
            _log.exception("bus_failed")
            raise
        finally:
            self._shutdown()
        return 0

    def _step(self) -> None:
        now = time.monotonic()
        if self.pacer is not None:
            self.pacer.step(self, now)
        if self.config.skip_idle:
            self._skip_idle(now)
            now = time.monotonic()
        self._run_due_actions(now)
        self._telemetry_tick(now)
        self._watch_payload(now)
        self._reconcile_power(now)
        self._forward()
        self.store.flush()
        timeout = self._next_due(time.monotonic())
        self._receive(timeout)

    def _skip_idle(self, now: float) -> None:
        """Jump the trace clock to the next trace action when nothing can happen before it."""
        if not self.actions:
            return
        target = self.actions[0].trace_s
        trace_now = self.clock.trace_s(now)
        holds = [h for h in self.config.hold_at_s if h > trace_now]
        if holds:
            target = min(target, min(holds))
        if target <= trace_now:
            return
        off_waiting = not self.switch.is_on() and not self.trace_on and self.actions[0].kind == "power_on"
        idle = (
            self.switch.is_on()
            and self.payload_rid is not None
            and self.payload_idle_since is not None
            and now - self.payload_idle_since > IDLE_CONFIRM_S
            and not len(self.store.pending())
            and self.payload_queue_depth == 0
        )
        if not (off_waiting or idle):
            return
        delta = self.clock.at(target) - now
        if delta < SKIP_MIN_S:
            return
        self.clock.t0 -= delta
        self.buslog.write(
            bl.CLOCK_SKIP,
            **self._stamp(),
            from_trace_s=round(trace_now, 3),
            to_trace_s=round(target, 3),
            reason="payload off" if off_waiting else "payload idle",
        )

    def _next_due(self, now: float) -> float:
        due = now + POLL_MAX_S
        if self.actions:
            due = min(due, self.clock.at(self.actions[0].trace_s))
        return max(0.0, due - now)

    def _receive(self, timeout_s: float) -> None:
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        poller.register(self.payload_sock, zmq.POLLIN)
        ready = dict(poller.poll(int(math.ceil(timeout_s * 1000))))
        # Bounded batches keep cuts on time while a ground floods the link.
        for _ in range(64):
            got = False
            if ready.get(self.payload_sock) or self.payload_sock.poll(0, zmq.POLLIN):
                received = recv_packet(self.payload_sock, timeout_s=0)
                if received is not None:
                    got = True
                    self._on_payload_packet(received)
            if ready.get(self.commands) or self.commands.poll(0, zmq.POLLIN):
                received = recv_packet(self.commands, timeout_s=0)
                if received is not None:
                    got = True
                    self._on_ground_packet(received)
            ready = {}
            if not got:
                break
            if self.actions and time.monotonic() >= self.clock.at(self.actions[0].trace_s):
                break

    # ------------------------------------------------------------------ trace timeline
    def _stamp(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        return {"trace_s": self.clock.trace_s(now), "clock_s": self.clock.clock_s(now), "wall_s": now - self.clock.t0}

    def _run_due_actions(self, now: float) -> None:
        while self.actions and now >= self.clock.at(self.actions[0].trace_s):
            action = self.actions.popleft()
            if action.kind == "power_on":
                self.trace_on = True
                self._reconcile_power(time.monotonic(), force=True)
            elif action.kind == "cut":
                self.trace_on = False
                self.pending_warning = None
                self.off_cause, self.off_origin = TRACE_CAUSE[action.cause], "trace"
                self._reconcile_power(time.monotonic(), force=True)
            elif action.kind == "warning":
                self.pending_warning = (action.trace_s + action.lead_s, action.cause, action.lead_s)
                self._warn(redelivered=False)
            elif action.kind == "end":
                self._trace_end()

    def _warn(self, *, redelivered: bool) -> None:
        """Publish the pending warning, and send it to the payload if it is connected."""
        if self.pending_warning is None:
            return
        cut_at, cause, lead = self.pending_warning
        now = time.monotonic()
        remaining_trace = max(0.0, cut_at - self.clock.trace_s(now))
        message = m.ShutdownWarning(
            trace_time_s=self.clock.clock_s(now),
            lead_time_s=remaining_trace * self.clock.scale,
            cause=TRACE_CAUSE[cause],
        )
        packet = self._bus_packet(message)
        self._publish(packet)
        delivered = self._to_payload(packet)
        self.buslog.write(
            bl.WARNING,
            **self._stamp(now),
            cause=TRACE_CAUSE[cause].value,
            trace_cause=cause.value,
            lead_trace_s=round(lead, 6),
            remaining_trace_s=round(remaining_trace, 6),
            lead_clock_s=round(remaining_trace * self.clock.scale, 6),
            cut_at_trace_s=cut_at,
            delivered=delivered,
            redelivered=redelivered,
        )
        _log.info(
            "bus_shutdown_warning",
            lead_s=message.lead_time_s,
            cause=message.cause.value,
            delivered=delivered,
            redelivered=redelivered,
        )

    def _trace_end(self) -> None:
        self.trace_ended = True
        self.buslog.write(bl.TRACE_END, **self._stamp(), action="stop" if self.config.stop_at_end else "keep_on")
        _log.info("bus_trace_end", stop=self.config.stop_at_end)
        if self.config.stop_at_end:
            self.off_cause, self.off_origin = PowerCause.TRACE, "end"
            self.request_stop("trace_end")
        else:
            # Keep the payload powered from now on, so that queued work can finish.
            self.trace_on = True

    # ------------------------------------------------------------------ power
    def _desired_on(self, now: float) -> bool:
        return self.trace_on and now >= self.fdir_hold_until and not self._stop.is_set()

    def _reconcile_power(self, now: float, force: bool = False) -> None:
        desired = self._desired_on(now)
        if desired == self.switch.is_on():
            return
        if not force and now < self.next_switch_attempt:
            return
        if desired:
            self._power_on()
        else:
            self._power_off(self.off_cause, self.off_origin)

    def _switch_failed(self, action: str, exc: Exception) -> None:
        self.next_switch_attempt = time.monotonic() + SWITCH_RETRY_S
        self.fault_count += 1
        self.last_fault = clip_utf8(f"power switch {action} failed: {exc}", MAX_EVENT_TEXT_BYTES)
        self.buslog.write(bl.SWITCH_ERROR, **self._stamp(), action=action, error=str(exc)[:500])
        _log.error("bus_power_switch_failed", action=action, error=str(exc))
        self._publish_fdir()

    def _power_on(self) -> None:
        now = time.monotonic()  # the moment power is applied; spawning takes a few ms more
        try:
            self.switch.on()
        except PowerSwitchError as exc:
            self._switch_failed("on", exc)
            return
        self.power_count += 1
        self.powered_at = now
        self.payload_rid = None
        self.last_seen = None
        self.gap_reported = False
        if self.fdir_mode is FdirMode.SAFE:
            self.fdir_mode = FdirMode.NOMINAL
        self.buslog.write(
            bl.POWER_ON,
            **self._stamp(now),
            cause=PowerCause.RESTORED.value,
            power_cycle=self.power_count,
            pid=self.switch.pid,
        )
        _log.info(
            "bus_power_on", trace_s=round(self.clock.trace_s(now), 3), pid=self.switch.pid, cycle=self.power_count
        )
        self._publish(
            self._bus_packet(
                m.PowerStateChange(trace_time_s=self.clock.clock_s(now), payload_on=True, cause=PowerCause.RESTORED)
            )
        )
        self._publish_power_report(now)

    def _power_off(self, cause: PowerCause, origin: str) -> None:
        pid = self.switch.pid
        was_on = self.switch.is_on()
        write_bytes = process_write_bytes(pid) if self.config.power_driver == "local" else None
        now = time.monotonic()  # the moment of the cut: SIGKILL goes out right after this
        try:
            self.switch.off(cause.value)
        except PowerSwitchError as exc:
            self._switch_failed("off", exc)
            return
        self.payload_rid = None
        self.powered_at = None
        self.last_off_fault = origin == "fdir"
        self.buslog.write(
            bl.POWER_OFF,
            **self._stamp(now),
            cause=cause.value,
            origin=origin,
            pid=pid,
            was_on=was_on,
            power_cycle=self.power_count,
            payload_write_bytes=write_bytes,
        )
        _log.info("bus_power_off", trace_s=round(self.clock.trace_s(now), 3), cause=cause.value, origin=origin, pid=pid)
        self._publish(
            self._bus_packet(m.PowerStateChange(trace_time_s=self.clock.clock_s(now), payload_on=False, cause=cause))
        )
        self._publish_power_report(now)

    def _fdir(self, reason: str, now: float) -> None:
        """Power-cycle the payload: cut it now, power it again after fdir_off_s (if the trace
        still has it on then)."""
        self.fault_count += 1
        self.last_fault = clip_utf8(reason, MAX_EVENT_TEXT_BYTES)
        self.fdir_mode = FdirMode.SAFE
        self.buslog.write(
            bl.FDIR_ACTION,
            **self._stamp(now),
            action="power_cycle",
            reason=reason,
            off_s=self.config.fdir_off_s,
            fault_count=self.fault_count,
        )
        _log.warning("bus_fdir_power_cycle", reason=reason, fault_count=self.fault_count)
        self.fdir_hold_until = now + self.config.fdir_off_s
        self._power_off(PowerCause.FDIR, "fdir")
        self._publish_fdir()

    def _watch_payload(self, now: float) -> None:
        if not self.switch.is_on():
            return
        status = self.switch.poll()
        if status is not None:
            self.buslog.write(bl.PAYLOAD_EXITED, **self._stamp(now), status=status, power_cycle=self.power_count)
            _log.warning("bus_payload_exited", status=status)
            self._fdir(f"payload process exited by itself with status {status}", now)
            return
        cfg = self.config
        if self.payload_rid is None:
            if cfg.boot_timeout_s and self.powered_at is not None and now - self.powered_at > cfg.boot_timeout_s:
                self.buslog.write(
                    bl.HEARTBEAT_GAP,
                    **self._stamp(now),
                    gap_s=round(now - self.powered_at, 3),
                    action="power_cycle",
                    phase="boot",
                )
                self._fdir(f"no heartbeat within {cfg.boot_timeout_s:g} s of power-on", now)
            return
        silent = now - self.last_seen
        if cfg.heartbeat_timeout_s and silent > cfg.heartbeat_timeout_s:
            self.buslog.write(
                bl.HEARTBEAT_GAP, **self._stamp(now), gap_s=round(silent, 3), action="power_cycle", phase="running"
            )
            self._fdir(f"no heartbeat for {silent:.1f} s", now)
        elif silent > cfg.heartbeat_gap_log_s and not self.gap_reported:
            self.gap_reported = True
            self.fdir_mode = FdirMode.DEGRADED
            self._publish_fdir()

    # ------------------------------------------------------------------ telemetry
    def _bus_packet(self, message: m.Message) -> bytes:
        return encode(message, Apid.BUS, self.tm_counter.next(Apid.BUS), source_id=NodeId.BUS)

    def _publish(self, packet: bytes) -> None:
        try:
            send_packet(self.telemetry, packet, timeout_s=0.05)
        except LinkError as exc:  # a PUB socket drops rather than blocks; this is not expected
            _log.warning("bus_publish_failed", error=str(exc))

    def _publish_power_report(self, now: float, to_payload: bool = False) -> None:
        sample = self.last_sample
        if sample is None or None in (sample.bus_voltage_v, sample.battery_soc, sample.payload_power_w):
            return  # the trace did not measure these channels: nothing honest to report
        packet = self._bus_packet(
            m.PowerReport(
                trace_time_s=self.clock.clock_s(now),
                payload_on=self.switch.is_on(),
                bus_voltage_v=sample.bus_voltage_v,
                payload_power_w=sample.payload_power_w,
                battery_soc=sample.battery_soc,
            )
        )
        self._publish(packet)
        if to_payload:
            self._to_payload(packet)

    def _publish_fdir(self) -> None:
        self._publish(
            self._bus_packet(
                m.FdirReport(
                    trace_time_s=self.clock.clock_s(),
                    mode=self.fdir_mode,
                    fault_count=self.fault_count,
                    last_fault=self.last_fault,
                )
            )
        )

    def _telemetry_tick(self, now: float) -> None:
        if self.trace_ended:
            # After the trace: the last sample, once per wall second.
            if now < self.next_tm_after_end:
                return
            self.next_tm_after_end = now + 1.0
        else:
            if now < self.clock.at(self.next_tm_trace):
                return
            trace_s = self.clock.trace_s(now)
            # Behind by more than a step (a stalled loop): skip ahead rather than burst.
            while self.clock.at(self.next_tm_trace) <= now:
                self.next_tm_trace += self.tm_step
            sample = self.trace.telemetry_at(min(trace_s, self.trace.duration_s))
            if sample is not None:
                self.last_sample = sample
        # Power and thermal rounds also go to a connected payload: the trends towards the limits
        # that end its windows are what its checkpoint cadence plans with (docs/engine.md).
        self._publish_power_report(now, to_payload=True)
        sample = self.last_sample
        if sample is not None and sample.payload_temp_c is not None:
            packet = self._bus_packet(
                m.ThermalReport(
                    trace_time_s=self.clock.clock_s(now),
                    payload_temp_c=sample.payload_temp_c,
                    bus_temp_c=self.config.bus_temp_c,
                )
            )
            self._publish(packet)
            self._to_payload(packet)
        self._publish_fdir()

    # ------------------------------------------------------------------ ground link
    def _ground_allowed(self, user: str | None) -> bool:
        if user is None or user == self.config.payload_client:
            return False
        allowed = self.config.ground_clients
        return allowed is None or user in allowed

    def _reject_ground(
        self,
        received,
        error: WireError,
        request: RequestRef | None = None,
        task_id: str | None = None,
        type_name: str | None = None,
    ) -> None:
        report = m.Rejected.from_error(error, request, task_id)
        packet = self._bus_packet(report)
        self._publish(packet)
        try:
            send_packet(self.commands, packet, routing_id=received.routing_id, timeout_s=0.1)
        except LinkError:
            pass
        req = report.request
        self.buslog.write(
            bl.COMMAND_REJECTED,
            **self._stamp(),
            request=_request_dict(req),
            type=type_name,
            task_id=task_id,
            code=error.code.name,
            reason=error.reason,
            sender=received.user_id,
        )
        _log.warning("bus_command_rejected", code=error.code.name, reason=error.reason, sender=received.user_id)

    def _on_ground_packet(self, received) -> None:
        packet = received.packet
        if not self._ground_allowed(received.user_id):
            try:
                request = decode(packet)[0].request
            except WireError as exc:
                request = exc.request
            self.buslog.write(bl.LINK_REFUSED, **self._stamp(), link="commands", client=received.user_id)
            self._reject_ground(
                received,
                WireError(ResponseCode.NOT_AUTHORIZED, f"client {received.user_id!r} may not command the payload"),
                request,
            )
            return
        try:
            header, message = decode(packet)
        except WireError as exc:
            self._reject_ground(received, exc)
            return
        request = header.request
        task_id = getattr(message, "task_id", None)
        name = message.TYPE.name
        if not message.is_command():
            self._reject_ground(
                received,
                WireError(ResponseCode.WRONG_PACKET_TYPE, f"{name} is telemetry; the commands link takes telecommands"),
                request,
                task_id,
                name,
            )
            return
        if header.apid != Apid.PAYLOAD:
            self._reject_ground(
                received,
                WireError(
                    ResponseCode.WRONG_APID,
                    f"APID {header.apid:#05x}: telecommands go to the payload ({int(Apid.PAYLOAD):#05x})",
                ),
                request,
                task_id,
                name,
            )
            return
        if header.source_id not in GROUND_SOURCE_IDS:
            self._reject_ground(
                received,
                WireError(ResponseCode.NOT_AUTHORIZED, f"source id {header.source_id:#06x} is not a ground station's"),
                request,
                task_id,
                name,
            )
            return
        if self.store.find(request_key(request)) is not None:
            self._reject_ground(
                received,
                WireError(
                    ResponseCode.REPLAYED_SEQUENCE,
                    f"seq {request.seq} from source {request.source_id} is already queued",
                ),
                request,
                task_id,
                name,
            )
            return
        entry = self.store.enqueue(packet, received.user_id, time.time())
        self.store.flush()  # durable before anything else happens to it (or is logged about it)
        self._remember_route(request, received.routing_id)
        self._expect_replies(request, message)
        extra = {"packet": base64.b64encode(packet).decode("ascii")} if self.config.log_packets else {}
        self.buslog.write(
            bl.COMMAND_RECEIVED,
            **self._stamp(),
            request=_request_dict(request),
            type=name,
            task_id=task_id,
            sender=received.user_id,
            store_id=entry.store_id,
            payload_on=self.switch.is_on(),
            payload_connected=self.payload_rid is not None,
            queued=len(self.store),
            **extra,
        )
        _log.info(
            "bus_command_received",
            type=name,
            seq=request.seq,
            source=request.source_id,
            task_id=task_id,
            store_id=entry.store_id,
            queued=len(self.store),
        )

    def _expect_replies(self, request: RequestRef, message: m.Message) -> None:
        """Note what the payload will answer this telecommand with, to route the answer back."""
        if isinstance(message, m.UplinkTask):
            self.task_owner[message.task_id] = request_key(request)
        reply = REPLY_TO.get(message.TYPE)
        if reply is not None:
            reply_type, field_name = reply
            self.expectations.append(
                _Expectation(
                    reply_type,
                    field_name,
                    getattr(message, field_name) if field_name else None,
                    request_key(request),
                    request.source_id,
                    time.monotonic(),
                )
            )

    def _remember_route(self, request: RequestRef, routing_id: bytes) -> None:
        routes = self.route_by_request
        routes[request_key(request)] = routing_id
        if len(routes) > ROUTES_KEPT:
            for key in list(routes)[: len(routes) - ROUTES_KEPT]:
                del routes[key]
        self.route_by_source[request.source_id] = routing_id

    def _to_ground(self, packet: bytes, key: tuple | None, source_id: int | None) -> bool:
        """Send to the connection that sent the telecommand, else to that station's latest."""
        candidates = []
        if key is not None and key in self.route_by_request:
            candidates.append(self.route_by_request[key])
        if source_id is not None and source_id in self.route_by_source:
            candidates.append(self.route_by_source[source_id])
        for rid in dict.fromkeys(candidates):
            try:
                send_packet(self.commands, packet, routing_id=rid, timeout_s=0.1)
                return True
            except LinkError:
                continue
        return False

    # ------------------------------------------------------------------ payload link
    def _to_payload(self, packet: bytes) -> bool:
        if self.payload_rid is None:
            return False
        try:
            send_packet(self.payload_sock, packet, routing_id=self.payload_rid, timeout_s=0.2)
            return True
        except LinkError as exc:
            _log.info("bus_payload_link_lost", error=str(exc))
            self.payload_rid = None
            return False

    def _forward(self) -> None:
        """Send live commands in order to the current payload connection, at most
        max_in_flight unconfirmed at a time; each is marked durably before it is sent."""
        if self.payload_rid is None or not self.switch.is_on() or not len(self.store):
            return
        pending = self.store.pending()
        in_flight = sum(1 for e in pending if e.sent_link == self.link_id)
        batch: list[StoredCommand] = []
        for entry in pending:
            if entry.sent_link == self.link_id:
                continue
            if in_flight + len(batch) >= self.config.max_in_flight:
                break
            batch.append(entry)
        if not batch:
            return
        self.payload_queue_depth = None  # a command may add work: wait for the next housekeeping report
        for entry in batch:
            self.store.mark_forwarded(entry, self.link_id)
        self.store.flush()
        for entry in batch:
            if not self._to_payload(entry.packet):
                return
            entry.sent_link, entry.sent_at = self.link_id, time.monotonic()
            for expectation in self.expectations:
                if expectation.key == entry.key:
                    expectation.armed = True
            self.buslog.write(
                bl.COMMAND_FORWARDED,
                **self._stamp(),
                store_id=entry.store_id,
                type=entry.type_name,
                request=_request_dict(entry.request),
                task_id=entry.task_id,
                link=self.link_id,
                redelivery=entry.forwards > 1,
            )

    def _on_payload_packet(self, received) -> None:
        now = time.monotonic()
        if received.user_id != self.config.payload_client:
            self.buslog.write(bl.LINK_REFUSED, **self._stamp(now), link="payload", client=received.user_id)
            _log.warning("bus_payload_link_refused", client=received.user_id)
            try:
                request = decode(received.packet)[0].request
            except WireError as exc:
                request = exc.request
            report = m.Rejected.from_error(
                WireError(ResponseCode.NOT_AUTHORIZED, f"client {received.user_id!r} is not the payload"), request
            )
            try:
                send_packet(self.payload_sock, self._bus_packet(report), routing_id=received.routing_id, timeout_s=0.1)
            except LinkError:
                pass
            return
        try:
            header, message = decode(received.packet)
        except WireError as exc:
            _log.warning("bus_payload_packet_bad", code=exc.code.name, reason=exc.reason)
            return
        if message.is_command():
            _log.warning("bus_payload_sent_command", type=message.TYPE.name)
            return
        if self.switch.is_on() and received.routing_id != self.payload_rid:
            self._payload_connected(received.routing_id, message, now)
        if self.pacer is not None:
            self.pacer.payload_message(self, message, now)
        if received.routing_id == self.payload_rid:
            if self.last_seen is not None and now - self.last_seen > self.config.heartbeat_gap_log_s:
                self.buslog.write(
                    bl.HEARTBEAT_GAP,
                    **self._stamp(now),
                    gap_s=round(now - self.last_seen, 3),
                    action="none",
                    phase="running",
                )
                if self.fdir_mode is FdirMode.DEGRADED:
                    self.fdir_mode = FdirMode.NOMINAL
            self.last_seen = now
            self.gap_reported = False
            if isinstance(message, m.Housekeeping):
                self.payload_queue_depth = message.queue_depth
            if isinstance(message, m.Heartbeat):
                self._confirm_by_time(now)
                if message.current_task is None:
                    self.payload_idle_since = self.payload_idle_since or now
                else:
                    self.payload_idle_since = None
        self._publish(received.packet)
        self._route_payload_report(message, received.packet, now)

    def _payload_connected(self, rid: bytes, message: m.Message, now: float) -> None:
        self.link_id += 1
        self.payload_rid = rid
        self.last_seen = now
        self.payload_idle_since = None
        self.payload_queue_depth = None  # unknown until its next housekeeping report
        boot_count = message.boot_count if isinstance(message, m.Heartbeat) else None
        self.buslog.write(
            bl.PAYLOAD_CONNECTED,
            **self._stamp(now),
            link=self.link_id,
            boot_count=boot_count,
            after_power_on_s=round(now - self.powered_at, 3) if self.powered_at else None,
            queued=len(self.store),
        )
        _log.info("bus_payload_connected", link=self.link_id, boot_count=boot_count, queued=len(self.store))
        self._to_payload(
            self._bus_packet(
                m.PowerStateChange(
                    trace_time_s=self.clock.clock_s(now),
                    payload_on=True,
                    cause=PowerCause.RESTORED,
                    after_fault=self.last_off_fault,
                )
            )
        )
        if self.pending_warning is not None:
            self._warn(redelivered=True)

    def _confirm_by_time(self, now: float) -> None:
        """Telecommands that asked for no acceptance report cannot be confirmed by one: once the
        payload has lived `confirm_after_s` after receiving one, it counts as delivered."""
        for entry in self.store.pending():
            if (
                entry.sent_link == self.link_id
                and entry.sent_at is not None
                and now - entry.sent_at >= self.config.confirm_after_s
                and not entry.wants_acceptance
            ):
                self.store.confirm(entry, "assumed")
                self.buslog.write(
                    bl.COMMAND_CONFIRMED,
                    **self._stamp(now),
                    store_id=entry.store_id,
                    type=entry.type_name,
                    request=_request_dict(entry.request),
                    how="assumed",
                )

    def _route_payload_report(self, message: m.Message, packet: bytes, now: float) -> None:
        if isinstance(message, m.Verification):
            request = message.request
            key = request_key(request)
            code = getattr(message, "code", None)
            suppressed = False
            entry = self.store.find(key)
            if entry is not None:
                how = message.TYPE.name.lower()
                if code == ResponseCode.REPLAYED_SEQUENCE and entry.forwards > 1:
                    # A redelivery the payload had already accepted before it lost power: the
                    # command ran once; the ground gets the payload's other reports about it.
                    how, suppressed = "redelivery_duplicate", True
                self.store.confirm(entry, how)
                self.buslog.write(
                    bl.COMMAND_CONFIRMED,
                    **self._stamp(now),
                    store_id=entry.store_id,
                    type=entry.type_name,
                    request=_request_dict(request),
                    how=how,
                )
            if message.TYPE in (MessageType.REJECTED, MessageType.FAILED, MessageType.COMPLETED):
                self.expectations = [e for e in self.expectations if e.key != key]
            routed = False if suppressed else self._to_ground(packet, key, request.source_id)
            self.buslog.write(
                bl.PAYLOAD_REPORT,
                **self._stamp(now),
                type=message.TYPE.name,
                request=_request_dict(request),
                task_id=message.task_id,
                code=ResponseCode(code).name if code is not None else None,
                routed=routed,
                **(
                    {"phase": message.phase.value, "done": message.done, "total": message.total}
                    if isinstance(message, m.Progress)
                    else {}
                ),
            )
            return
        if message.TYPE in (
            MessageType.PONG,
            MessageType.HOUSEKEEPING,
            MessageType.TASK_RESULT,
            MessageType.IMAGE_STATUS,
        ):
            self._route_reply(message, packet, now)
        elif isinstance(message, m.Event):
            self.buslog.write(
                bl.PAYLOAD_REPORT,
                **self._stamp(now),
                type="EVENT",
                event=message.event_id.name,
                task_id=message.task_id,
                text=message.text[:200],
            )

    def _route_reply(self, message: m.Message, packet: bytes, now: float) -> None:
        self.expectations = [e for e in self.expectations if now - e.created < REPLY_EXPECTATION_S]
        match = None
        for expectation in self.expectations:
            if expectation.reply != message.TYPE or not expectation.armed:
                continue
            if expectation.field_name is None or getattr(message, expectation.field_name) == expectation.value:
                match = expectation
                break
        key = source = None
        if match is not None:
            self.expectations.remove(match)
            key, source = match.key, match.source_id
        elif isinstance(message, m.TaskResult) and message.task_id in self.task_owner:
            key = self.task_owner[message.task_id]
            source = key[1]
        # A task's answer goes into the run log in full (a replay compares it bit for bit).
        result = (
            {
                "token_ids": list(message.token_ids),
                "logits_sha256": bytes(message.logits_sha256).hex(),
                "interruptions": message.interruptions,
            }
            if isinstance(message, m.TaskResult)
            else {}
        )
        if key is None:
            if result:
                self.buslog.write(
                    bl.PAYLOAD_REPORT,
                    **self._stamp(now),
                    type=message.TYPE.name,
                    request=None,
                    task_id=message.task_id,
                    code=None,
                    routed=False,
                    **result,
                )
            return  # periodic housekeeping: telemetry only
        routed = self._to_ground(packet, key, source)
        self.buslog.write(
            bl.PAYLOAD_REPORT,
            **self._stamp(now),
            type=message.TYPE.name,
            request=_request_dict(RequestRef(*key)),
            task_id=getattr(message, "task_id", None),
            code=None,
            routed=routed,
            **result,
        )

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> None:
        if not self._started:
            self._close_sockets()
            return
        try:
            if self.switch.is_on():
                origin = "end" if self.stop_reason == "trace_end" else "shutdown"
                cause = PowerCause.TRACE if origin == "end" else PowerCause.COMMANDED
                self._power_off(cause, origin)
                if self.switch.is_on():  # the switch refused: one more try, then give up
                    self._power_off(cause, origin)
        finally:
            try:
                self.switch.close()  # drivers with helpers (a zygote) release them
            except PowerSwitchError as exc:
                _log.error("bus_power_switch_close_failed", error=str(exc))
            try:
                self.store.flush()
            finally:
                self.buslog.write(
                    bl.RUN_STOP, **self._stamp(), reason=self.stop_reason, stored_commands=len(self.store)
                )
                self.buslog.close()
                _log.info("bus_stopped", reason=self.stop_reason, stored_commands=len(self.store))
                self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("commands", "payload_sock", "telemetry"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=200)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if getattr(self, "_lock_fd", None) is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None


# ---------------------------------------------------------------------- running a bus


class BusThread:
    """A bus in a background thread of this process (tests, the testbench, the demo).

    with BusThread(config) as bus:
        bus.endpoints.commands ...
    """

    def __init__(self, config: BusConfig, switch: PowerSwitch | None = None, pacer=None):
        self.bus = Bus(config, switch, pacer)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="mock-bus", daemon=True)

    def _main(self) -> None:
        try:
            self.bus.run()
        except BaseException as exc:  # reported by stop()
            self.error = exc
            self.bus.ready.set()

    @property
    def endpoints(self) -> Endpoints:
        return self.bus.endpoints

    @property
    def log_path(self) -> Path:
        return self.bus.data_dir / bl.LOG_FILE

    def start(self, timeout_s: float = 30.0) -> BusThread:
        # The switch spawns the payload from the bus thread: its parent-death signal is tied
        # to that thread, so the payload dies with the bus.
        self._thread.start()
        if not self.bus.ready.wait(timeout_s) or self.error is not None:
            raise RuntimeError(f"bus did not start: {self.error!r}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.bus.request_stop()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("bus thread did not stop")
        if self.error is not None:
            raise self.error

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> BusThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def config_to_argv(config: BusConfig) -> list[str]:
    """`ow bus run` arguments equivalent to `config` (BusProcess uses them)."""
    c = config
    e = c.endpoints
    argv = [
        "--trace",
        str(c.trace),
        "--data-dir",
        str(c.data_dir),
        "--keys",
        str(c.keys_dir),
        "--time-scale",
        repr(float(c.time_scale)),
        "--start-at",
        repr(float(c.start_at_s)),
        "--commands-endpoint",
        e.commands,
        "--payload-endpoint",
        e.payload,
        "--telemetry-endpoint",
        e.telemetry,
        "--power-driver",
        c.power_driver,
        "--heartbeat-timeout",
        repr(float(c.heartbeat_timeout_s)),
        "--boot-timeout",
        repr(float(c.boot_timeout_s)),
        "--heartbeat-gap-log",
        repr(float(c.heartbeat_gap_log_s)),
        "--fdir-off",
        repr(float(c.fdir_off_s)),
        "--confirm-after",
        repr(float(c.confirm_after_s)),
        "--max-in-flight",
        str(c.max_in_flight),
        "--telemetry-max-hz",
        repr(float(c.telemetry_max_hz)),
        "--bus-temp-c",
        repr(float(c.bus_temp_c)),
        "--payload-client",
        c.payload_client,
        "--switch-timeout",
        repr(float(c.switch_timeout_s)),
    ]
    if c.stop_at_end:
        argv.append("--stop-at-end")
    if c.skip_idle:
        argv.append("--skip-idle")
    for hold in c.hold_at_s:
        argv += ["--hold-at", repr(float(hold))]
    if not c.log_packets:
        argv.append("--no-log-packets")
    optional = {
        "--payload-connect-endpoint": c.payload_connect_endpoint,
        "--model": c.model,
        "--payload-data-dir": c.payload_data_dir,
        "--payload-keys": c.payload_keys_dir,
        "--ssh-host": c.ssh_host,
        "--ssh-user": c.ssh_user,
        "--ssh-port": c.ssh_port,
        "--ssh-identity": c.ssh_identity,
        "--ssh-pidfile": c.ssh_pidfile,
        "--ssh-kill-command": c.ssh_kill_command,
        "--ssh-reboot-command": c.ssh_reboot_command,
        "--power-on-command": c.power_on_command,
        "--power-off-command": c.power_off_command,
        "--ready-file": c.ready_file,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--ssh-mode", c.ssh_mode]
    if c.payload_command is not None:
        argv += ["--payload-command", shlex.join(c.payload_command)]
    if c.ssh_transport is not None:
        argv += ["--ssh-transport", shlex.join(c.ssh_transport)]
    for option in c.ssh_options:
        argv += ["--ssh-option", option]
    for client in c.ground_clients or ():
        argv += ["--ground-client", client]
    for arg in c.flight_args:
        argv.append(f"--flight-arg={arg}")
    if c.boot_trace_s is not None:
        argv += ["--boot-trace-s", repr(float(c.boot_trace_s))]
    for entry in c.zygote_preload or ():
        argv += ["--zygote-preload", entry]
    return argv


class BusProcess:
    """`ow bus run` as a child process (what the testbench does to kill the bus itself).

        bus = BusProcess(config).start()      # waits until the sockets are bound
        bus.endpoints.commands ...
        bus.stop()                            # SIGTERM: cut the payload, flush, exit
        bus.kill()                            # SIGKILL: the bus dies with its state on disk

    The ready file defaults to <data_dir>/bus-ready.json."""

    def __init__(
        self,
        config: BusConfig,
        *,
        log_path: str | os.PathLike | None = None,
        python: str | None = None,
        env: dict | None = None,
    ):
        self.config = replace(config, ready_file=config.ready_file or Path(config.data_dir) / "bus-ready.json")
        self.ready_file = Path(self.config.ready_file)
        self.log_path = Path(log_path) if log_path else Path(config.data_dir) / "bus-stderr.log"
        self.argv = [python or sys.executable, "-m", "hil.bus_cli", "run", *config_to_argv(self.config)]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(commands=self.info["commands"], payload=self.info["payload"], telemetry=self.info["telemetry"])

    def start(self, timeout_s: float = 660.0) -> BusProcess:
        """Start `ow bus run` and wait for its ready file (written once its power switch is
        prepared: a zygote's imports can take minutes on a loaded machine, at most 600 s)."""
        Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                info = json.loads(self.ready_file.read_text())
                if info.get("pid") == self.proc.pid:
                    self.info = info
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"bus exited with {self.proc.returncode}; see {self.log_path}")
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"bus not ready within {timeout_s:g} s; see {self.log_path}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> BusProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
