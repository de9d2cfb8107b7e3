"""What a bus run is configured with (`BusConfig`, docs/bus.md §8) and how the payload's command
line is built from it."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

# PAYLOAD_CLIENT: the payload link's client name (key file stem) unless configured otherwise.
from common.wire.link import PAYLOAD_CLIENT, Endpoints

#: `ow flight run` with its placeholders, after whatever runs `ow`.
FLIGHT_RUN_ARGS = (
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
)


def default_payload_command(python: str | None = None) -> list[str]:
    """`ow flight run ...` as the local driver spawns it (the `ow` of this interpreter)."""
    return [python or sys.executable, "-m", "common.cli", *FLIGHT_RUN_ARGS]


#: The same for a remote board, where `ow` is on the PATH of the SSH login.
REMOTE_PAYLOAD_COMMAND = ["ow", *FLIGHT_RUN_ARGS]

PLACEHOLDERS = ("python", "payload_data_dir", "bus_data_dir", "model", "keys", "payload_endpoint")


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
    # stations and bounds (docs/bus.md §5 "Stations", "Bounds")
    #: commands one station (key) may have stored and not yet confirmed by the payload
    station_quota: int = 500
    #: commands a second each station may send, and how many it may send at once (token bucket;
    #: rate 0: no limit)
    station_rate: float = 50.0
    station_burst: int = 200
    #: the store holds at most this many commands, and this many bytes of packets, in all
    store_max_commands: int = 10_000
    store_max_bytes: int = 64 << 20
    #: STATION_THROTTLED at most once per station in this many wall seconds
    throttle_event_s: float = 10.0
    #: the run log: rotated past this size, this many files kept (the current one included)
    log_segment_bytes: int = 32 << 20
    log_segments: int = 8
    #: the boot-loop guard (docs/bus.md §6): after this many failed boots in a row the payload is
    #: held off (0 = never); a boot fails when the payload ends by itself, or is silent past
    #: boot_timeout_s, before it has been connected boot_settle_s
    boot_loop_limit: int = 5
    #: a hold ends by itself after this, doubled at each consecutive hold up to
    #: BOOT_LOOP_BACKOFF_MAX_S (0: only the ground's PAYLOAD_RETRY ends it)
    boot_loop_backoff_s: float = 60.0
    boot_settle_s: float = 10.0
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
    #: flight, the ground link quiet, no station waiting for an answer a cut took; docs/bus.md §1)
    #: until the next trace action -- never past a `hold_at_s` trace time (e.g. when the ground
    #: will send something)
    skip_idle: bool = False
    hold_at_s: Sequence[float] = ()
    #: trace time stands still from each power-on until the payload connects (or is cut): a
    #: window's trace time is then the payload's working time however long this machine takes to
    #: start it (tests and testbench runs on a loaded machine; docs/bus.md §2). Bounded by
    #: boot_timeout_s, after which FDIR power-cycles the payload as usual.
    hold_for_connect: bool = False
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
        for name in ("station_quota", "station_burst", "store_max_commands", "store_max_bytes", "log_segments"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BusConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.log_segment_bytes < 4096:
            raise BusConfigError(f"log_segment_bytes must be >= 4096, got {self.log_segment_bytes}")
        for name in ("station_rate", "throttle_event_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise BusConfigError(f"{name} must be >= 0, got {value}")
        if self.boot_trace_s is not None:
            if not (math.isfinite(self.boot_trace_s) and self.boot_trace_s >= 0):
                raise BusConfigError(f"--boot-trace-s must be >= 0, got {self.boot_trace_s}")
            if self.power_driver != "local":
                raise BusConfigError(
                    "--boot-trace-s (emulated boot) needs --power-driver local; a real board boots in real time"
                )
        for name in (
            "heartbeat_timeout_s",
            "boot_timeout_s",
            "fdir_off_s",
            "confirm_after_s",
            "boot_loop_backoff_s",
            "boot_settle_s",
        ):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise BusConfigError(f"{name} must be >= 0")
        if self.boot_loop_limit < 0:
            raise BusConfigError(f"--boot-loop-limit must be >= 0, got {self.boot_loop_limit}")


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
