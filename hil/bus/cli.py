"""`ow bus run`: the mock spacecraft bus from the command line (docs/bus.md).

`register_bus(subparsers)` adds the `bus` group to `ow`; `python -m hil.bus.cli run ...` runs
the same command without the rest of `ow`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys

from common import log
from common.cliargs import Group, add_args, arg
from common.errors import CliError
from common.wire.link import Endpoints

EXIT_CONFIG = 2

DESCRIPTION = """\
Replay an interruption trace against the compute payload: own its power switch (spawn the
flight process at each power-on, SIGKILL it at each cut, warn it first when the trace gives a
lead), publish power / thermal / FDIR telemetry, relay ground telecommands to the payload and
its reports back, and store commands durably while the payload is off. Every run appends a
run log to DATA_DIR/bus-log.jsonl.

Time: --time-scale X means one trace second lasts X wall seconds (0.01 = 100x faster than the
trace). Trace second t happens (t - START_AT) * X wall seconds after start. Telemetry carries
the bus clock, trace time * X, so warning leads are in the payload's own seconds."""

EPILOG = """\
placeholders in --payload-command: {python} {payload_data_dir} {bus_data_dir} {model} {keys}
{payload_endpoint} {flight_args}; --flight-arg values are appended (or put at {flight_args}).

at the trace's end the bus powers the payload (if off) and keeps it on until stopped;
--stop-at-end cuts it and exits instead. SIGINT/SIGTERM cut the payload and exit cleanly.
A restarted bus starts the trace again at --start-at; its stored commands survive.

examples:
  ow bus run --trace trace-a --time-scale 0.01 --data-dir runs/bus --keys keys --model models/tiny
  ow bus run --trace sat1-like --data-dir runs/bench --keys keys --power-driver ssh \\
      --ssh-host jetson.local --ssh-user ow --payload-data-dir /var/lib/ow --payload-keys /etc/ow/keys \\
      --model /opt/models/qwen3-vl-2b --payload-endpoint tcp://0.0.0.0:5551 \\
      --payload-connect-endpoint tcp://192.168.1.10:5551"""


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


#: `ow bus run`'s options, by group as `--help` shows them (common/cliargs.py).
_TRACE_AND_CLOCK_ARGS = Group(
    title="trace and clock",
    args=(
        arg("--trace", required=True, help="trace file or shipped trace name (docs/trace-format.md)"),
        arg(
            "--time-scale",
            type=_positive,
            default=1.0,
            metavar="X",
            help="wall seconds per trace second: 1 = real time, 0.01 = 100x faster (default 1)",
        ),
        arg("--start-at", type=_non_negative, default=0.0, metavar="S", help="start at trace second S (default 0)"),
        arg(
            "--stop-at-end",
            action="store_true",
            help="cut the payload and exit at the trace's end (default: keep the payload on)",
        ),
        arg(
            "--skip-idle",
            action="store_true",
            help="compressed long runs: jump the trace clock over spans where nothing can happen (payload "
            "off until its next power-on; payload on, connected and idle, the ground link quiet for 2 s and no "
            "station waiting for an answer a cut took, until the next trace event)",
        ),
        arg(
            "--hold-at",
            action="append",
            type=float,
            default=[],
            metavar="TRACE_S",
            help="with --skip-idle, never jump past this trace second (repeatable; e.g. when the ground "
            "will uplink something)",
        ),
        arg(
            "--hold-for-connect",
            action="store_true",
            help="trace time stands still from each power-on until the payload connects (or the boot "
            "timeout cuts it): each window is the payload's working time however slow this machine is "
            "to start it",
        ),
    ),
)


_PAYLOAD_PROCESS_ARGS = Group(
    title="payload process",
    args=(
        arg(
            "--payload-command",
            default=None,
            metavar="TEMPLATE",
            help="command line of the flight process (shell words with placeholders; default "
            "`ow flight run --data-dir {payload_data_dir} --model {model} --keys {keys} "
            "--payload-endpoint {payload_endpoint}`)",
        ),
        arg("--model", default=None, help="model directory passed to the flight process"),
        arg(
            "--flight-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="extra argument for the flight process (repeatable; use --flight-arg=--pace-ms)",
        ),
        arg(
            "--payload-data-dir",
            default=None,
            help="payload data directory as the payload sees it (default DATA_DIR/payload)",
        ),
        arg("--payload-keys", default=None, help="keys directory as the payload sees it (default --keys)"),
        arg(
            "--boot-trace-s",
            type=_non_negative,
            default=None,
            metavar="S",
            help="emulate the target's boot (local driver): fork each payload from a process that has "
            "imported its libraries and let it wait S trace seconds (S x --time-scale wall seconds) "
            "after power-on; default: exec it, with this machine's real start-up (docs/hil.md)",
        ),
        arg(
            "--zygote-preload",
            action="append",
            default=None,
            metavar="MODULE[:FUNCTION]",
            help="with --boot-trace-s: what the forking process imports (repeatable; default the flight "
            "payload's boot image, flight.runtime.preload:boot_image)",
        ),
    ),
)


_POWER_SWITCH_ARGS = Group(
    title="power switch",
    args=(
        arg(
            "--power-driver",
            choices=["local", "ssh", "command"],
            default="local",
            help="local: child process, SIGKILL of its group (default); ssh: flight process on a "
            "board over SSH; command: operator commands for a relay / PDU",
        ),
        arg("--ssh-host", default=None, help="board's host name or address (ssh driver)"),
        arg("--ssh-user", default=None),
        arg("--ssh-port", type=int, default=None),
        arg("--ssh-identity", default=None, help="private key file for ssh -i"),
        arg("--ssh-option", action="append", default=[], metavar="OPT", help="extra ssh -o option (repeatable)"),
        arg(
            "--ssh-mode",
            choices=["kill", "reboot"],
            default="kill",
            help="power-off on the board: SIGKILL of the flight process group (default) or a forced reboot",
        ),
        arg(
            "--ssh-pidfile",
            default="/tmp/orbitweaver-payload.pid",
            help="where the flight process's group id is kept on the board",
        ),
        arg(
            "--ssh-kill-command",
            default=None,
            help="remote script that kills the payload (each cut, and before each start); must exit 0 "
            "once nothing of it is left, also when nothing ran",
        ),
        arg(
            "--ssh-reboot-command",
            default=None,
            help="remote command for --ssh-mode reboot (default `sudo -n /sbin/reboot -f`)",
        ),
        arg(
            "--ssh-transport",
            default=None,
            help="argv prefix that reaches the board instead of ssh (runs its last argument as a shell script)",
        ),
        arg("--power-on-command", default=None, help="shell command that powers the payload (command driver)"),
        arg("--power-off-command", default=None, help="shell command that cuts the payload (command driver)"),
        arg(
            "--switch-timeout",
            type=_positive,
            default=30.0,
            metavar="S",
            help="a switch command taking longer fails (default 30)",
        ),
    ),
)


_HEALTH_AND_DELIVERY_ARGS = Group(
    title="health and delivery (wall seconds)",
    args=(
        arg(
            "--heartbeat-timeout",
            type=_non_negative,
            default=10.0,
            metavar="S",
            help="power-cycle a powered payload silent this long (FDIR; 0 = never; default 10)",
        ),
        arg(
            "--boot-timeout",
            type=_non_negative,
            default=60.0,
            metavar="S",
            help="power-cycle a payload that has not connected this long after power-on (0 = never; default 60)",
        ),
        arg(
            "--heartbeat-gap-log",
            type=_non_negative,
            default=3.0,
            metavar="S",
            help="log heartbeat gaps longer than this (default 3)",
        ),
        arg(
            "--fdir-off",
            type=_non_negative,
            default=2.0,
            metavar="S",
            help="off time of an FDIR power cycle (default 2)",
        ),
        arg(
            "--confirm-after",
            type=_non_negative,
            default=2.0,
            metavar="S",
            help="a command that asked for no acceptance report counts as delivered after the payload "
            "lived this long past it (default 2)",
        ),
        arg(
            "--max-in-flight",
            type=_positive_int,
            default=32,
            help="unconfirmed commands sent at a time, shared fairly between stations (default 32)",
        ),
        arg(
            "--boot-loop-limit",
            type=int,
            default=5,
            metavar="N",
            help="boot-loop guard: after N failed boots in a row (the payload ended by itself, or never "
            "connected, before it had been up --boot-settle s) hold it off with a PAYLOAD_BOOT_LOOP event "
            "naming the reason, until the ground's PAYLOAD_RETRY (`ow ground payload-retry`) or the "
            "back-off (0 = never hold; default 5)",
        ),
        arg(
            "--boot-loop-backoff",
            type=_non_negative,
            default=60.0,
            metavar="S",
            help="a hold ends by itself after S s, doubled at each hold in a row (at most 1 h, or S if "
            "larger); 0 = only the ground's retry ends it (default 60)",
        ),
        arg(
            "--boot-settle",
            type=_non_negative,
            default=10.0,
            metavar="S",
            help="a boot has come up once the payload has been connected S s; an exit or silence "
            "before that is a failed boot (default 10)",
        ),
    ),
)


_STATIONS_AND_BOUNDS_ARGS = Group(
    title="stations and bounds (docs/bus.md §5)",
    args=(
        arg(
            "--station-quota",
            type=_positive_int,
            default=500,
            metavar="N",
            help="commands one station may have stored and unconfirmed; more are refused STATION_QUOTA (default 500)",
        ),
        arg(
            "--station-rate",
            type=_non_negative,
            default=50.0,
            metavar="R",
            help="commands a second one station may send (token bucket); more are refused RATE_LIMITED "
            "(0 = no limit; default 50)",
        ),
        arg(
            "--station-burst",
            type=_positive_int,
            default=200,
            metavar="B",
            help="commands one station may send at once before --station-rate applies (default 200)",
        ),
        arg(
            "--store-max-commands",
            type=_positive_int,
            default=10_000,
            metavar="N",
            help="commands the bus stores in all; more are refused BUS_STORAGE_FULL (default 10000)",
        ),
        arg(
            "--store-max-mb",
            type=_positive,
            default=64.0,
            metavar="MB",
            help="MiB of command packets the bus stores in all; more are refused BUS_STORAGE_FULL (default 64)",
        ),
        arg(
            "--throttle-event-s",
            type=_non_negative,
            default=10.0,
            metavar="S",
            help="STATION_THROTTLED at most once per station in S seconds (default 10)",
        ),
    ),
)


_TELEMETRY_AND_LOGS_ARGS = Group(
    title="telemetry and logs",
    args=(
        arg(
            "--telemetry-max-hz",
            type=_positive,
            default=10.0,
            help="most telemetry rounds per wall second when time is compressed (default 10)",
        ),
        arg(
            "--bus-temp-c",
            type=float,
            default=20.0,
            help="bus structure temperature reported in THERMAL (not in traces; default 20)",
        ),
        arg(
            "--no-log-packets",
            dest="log_packets",
            action="store_false",
            help="do not keep telecommand bytes in the run log",
        ),
        arg(
            "--log-segment-mb",
            type=_positive,
            default=32.0,
            metavar="MB",
            help="rotate the run log past this size: bus-log.jsonl -> .1 -> .2 ... (default 32)",
        ),
        arg(
            "--log-segments",
            type=_positive_int,
            default=8,
            metavar="N",
            help="run log files kept, the current one included; the oldest beyond is removed (default 8)",
        ),
        arg("--log-level", default="info", choices=["debug", "info", "warning", "error"]),
    ),
)


def _environment_groups() -> tuple[Group, ...]:
    """The groups whose defaults come from the environment ($OW_KEYS_DIR, $OW_*_ENDPOINT), read
    when the parser is built, not when this module is imported."""
    env = Endpoints.from_env()
    return (
        Group(
            title="storage and keys",
            args=(
                arg(
                    "--data-dir",
                    required=True,
                    help="bus state: run log, stored commands, payload output (created if absent)",
                ),
                arg(
                    "--keys",
                    default=os.environ.get("OW_KEYS_DIR"),
                    required="OW_KEYS_DIR" not in os.environ,
                    help="keys directory with server/bus.key_secret and authorized/ (default $OW_KEYS_DIR)",
                ),
            ),
        ),
        Group(
            title="links (ZeroMQ endpoints the bus binds)",
            args=(
                arg(
                    "--commands-endpoint", default=env.commands, help=f"ground commands ROUTER (default {env.commands})"
                ),
                arg("--payload-endpoint", default=env.payload, help=f"payload ROUTER (default {env.payload})"),
                arg("--telemetry-endpoint", default=env.telemetry, help=f"telemetry PUB (default {env.telemetry})"),
                arg(
                    "--payload-connect-endpoint",
                    default=None,
                    help="payload endpoint as the payload connects to it, if it differs from the bound one "
                    "(bus bound to 0.0.0.0, payload on another host)",
                ),
                arg("--payload-client", default="payload", help="key name of the payload (default payload)"),
                arg(
                    "--ground-client",
                    action="append",
                    default=None,
                    metavar="NAME",
                    help="key name allowed on the commands link (repeatable; default: every authorized key "
                    "but the payload's)",
                ),
                arg("--ready-file", default=None, help="write the bound endpoints here as JSON once listening"),
            ),
        ),
    )


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    add_args(
        run,
        (
            _TRACE_AND_CLOCK_ARGS,
            *_environment_groups(),
            _PAYLOAD_PROCESS_ARGS,
            _POWER_SWITCH_ARGS,
            _HEALTH_AND_DELIVERY_ARGS,
            _STATIONS_AND_BOUNDS_ARGS,
            _TELEMETRY_AND_LOGS_ARGS,
        ),
    )


def register_bus(subparsers) -> None:
    """Add `bus` with its `run` leaf to the `ow` parser."""
    bus = subparsers.add_parser(
        "bus",
        help="the mock spacecraft bus",
        description="The mock spacecraft bus: power switch, telemetry, command relay.",
    )
    bsub = bus.add_subparsers(dest="bus_command", metavar="SUBCOMMAND")
    bsub.required = True
    run = bsub.add_parser(
        "run",
        help="replay a trace against the payload and relay its links",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(run)
    run.set_defaults(func=cmd_run)


def config_from_args(args):
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.bus import BusConfig

    return BusConfig(
        trace=args.trace,
        data_dir=args.data_dir,
        keys_dir=args.keys,
        time_scale=args.time_scale,
        start_at_s=args.start_at,
        stop_at_end=args.stop_at_end,
        skip_idle=args.skip_idle,
        hold_at_s=tuple(args.hold_at),
        hold_for_connect=args.hold_for_connect,
        endpoints=Endpoints(
            commands=args.commands_endpoint, payload=args.payload_endpoint, telemetry=args.telemetry_endpoint
        ),
        payload_connect_endpoint=args.payload_connect_endpoint,
        power_driver=args.power_driver,
        payload_command=shlex.split(args.payload_command) if args.payload_command else None,
        model=args.model,
        flight_args=list(args.flight_arg),
        payload_data_dir=args.payload_data_dir,
        payload_keys_dir=args.payload_keys,
        ssh_host=args.ssh_host,
        ssh_user=args.ssh_user,
        ssh_port=args.ssh_port,
        ssh_identity=args.ssh_identity,
        ssh_options=list(args.ssh_option),
        ssh_transport=shlex.split(args.ssh_transport) if args.ssh_transport else None,
        ssh_mode=args.ssh_mode,
        ssh_pidfile=args.ssh_pidfile,
        ssh_kill_command=args.ssh_kill_command,
        ssh_reboot_command=args.ssh_reboot_command,
        power_on_command=args.power_on_command,
        power_off_command=args.power_off_command,
        switch_timeout_s=args.switch_timeout,
        heartbeat_timeout_s=args.heartbeat_timeout,
        boot_timeout_s=args.boot_timeout,
        heartbeat_gap_log_s=args.heartbeat_gap_log,
        fdir_off_s=args.fdir_off,
        confirm_after_s=args.confirm_after,
        max_in_flight=args.max_in_flight,
        station_quota=args.station_quota,
        station_rate=args.station_rate,
        station_burst=args.station_burst,
        store_max_commands=args.store_max_commands,
        store_max_bytes=max(1, int(args.store_max_mb * 2**20)),
        throttle_event_s=args.throttle_event_s,
        log_segment_bytes=max(4096, int(args.log_segment_mb * 2**20)),
        log_segments=args.log_segments,
        boot_loop_limit=args.boot_loop_limit,
        boot_loop_backoff_s=args.boot_loop_backoff,
        boot_settle_s=args.boot_settle,
        telemetry_max_hz=args.telemetry_max_hz,
        bus_temp_c=args.bus_temp_c,
        payload_client=args.payload_client,
        ground_clients=args.ground_client,
        log_packets=args.log_packets,
        ready_file=args.ready_file,
        boot_trace_s=args.boot_trace_s,
        zygote_preload=args.zygote_preload,
    )


def cmd_run(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from hil.bus import Bus, BusConfigError

    log.setup(args.log_level, component="bus")
    try:
        bus = Bus(config_from_args(args))
        bus.start()
    except (BusConfigError, OSError) as exc:
        raise CliError(str(exc), EXIT_CONFIG) from None
    except Exception as exc:  # zmq bind errors (address in use) and the like
        raise CliError(f"{type(exc).__name__}: {exc}", EXIT_CONFIG) from None

    def stop(signum, _frame):
        bus.request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return bus.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ow")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register_bus(sub)
    if argv is None:
        argv = sys.argv[1:]
    args = parser.parse_args(["bus", *argv] if argv and argv[0] != "bus" else argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"ow bus: error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
