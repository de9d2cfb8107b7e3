"""`ow ground ...`: the operator's commands. Each is a thin layer over ground.client.GroundClient.

Exit status: 0 ok · 2 usage · 3 rejected or failed by the payload (code name and reason
printed) · 4 no answer, or the bus refused this station's key · 5 local input error (nothing
was sent) · 6 out of memory (common.errors, for every `ow` command).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import sys
import time
from pathlib import Path

from common import log
from common.cliargs import Command, Group, add_commands, arg
from common.errors import CliError, check_number
from common.wire import WireError
from common.wire.ids import is_admin_source
from common.wire.link import (
    DEFAULT_CLIENTS,
    PAYLOAD_CLIENT,
    Endpoints,
    KeyLayout,
    authorize_client,
    bind_station,
    init_keys,
    read_binding,
    station_bindings,
)
from common.wire.text import display_text
from ground.errors import EXIT_OK, GroundError, LocalInputError
from ground.link import DEFAULT_HANDSHAKE_TIMEOUT_S

_EPILOG = (
    "exit status: 0 ok; 2 usage; 3 rejected or failed by the payload; 4 no answer (payload off, bus down) "
    "or key refused; 5 local input error (nothing sent); 6 out of memory"
)


def _source_id(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 1 <= value <= 0xFF:
        raise argparse.ArgumentTypeError(f"{text} outside 1..255 (0x0001..0x00FF, ground stations)")
    return value


def _common_options() -> argparse.ArgumentParser:
    defaults = Endpoints.from_env()
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("link and station")
    g.add_argument(
        "--keys",
        metavar="DIR",
        default=None,
        help="keys directory (default: $OW_KEYS_DIR or ./keys); holds clients/<station>.key_secret, "
        "server/bus.key and the station state in state/",
    )
    g.add_argument(
        "--state-dir",
        metavar="DIR",
        default=None,
        help="ground state (sequence counter, task list, results, telemetry archive); default <keys>/state",
    )
    g.add_argument(
        "--station", metavar="NAME", default="ground", help="this station's client key name (default: ground)"
    )
    g.add_argument(
        "--source-id",
        metavar="N",
        type=_source_id,
        default=None,
        help="secondary-header source id, 1..255 (0x.. accepted); default: the one the bus binds to the "
        "station's key (<keys>/authorized/<station>.station or clients/<station>.station), else 1",
    )
    g.add_argument(
        "--commands-endpoint",
        metavar="URL",
        default=defaults.commands,
        help=f"bus commands endpoint (default: $OW_COMMANDS_ENDPOINT or {Endpoints().commands})",
    )
    g.add_argument(
        "--telemetry-endpoint",
        metavar="URL",
        default=defaults.telemetry,
        help=f"bus telemetry endpoint (default: $OW_TELEMETRY_ENDPOINT or {Endpoints().telemetry})",
    )
    g.add_argument(
        "--timeout",
        metavar="S",
        type=float,
        default=10.0,
        help="seconds to wait for an answer before calling it no answer (default: 10)",
    )
    g.add_argument(
        "--handshake-timeout",
        metavar="S",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT_S,
        help="seconds to wait for the CURVE handshake with the bus when the link opens, apart from "
        f"--timeout (default: {DEFAULT_HANDSHAKE_TIMEOUT_S:g})",
    )
    g.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    g.add_argument(
        "--log-level",
        default="error",
        choices=["debug", "info", "warning", "error"],
        help="structured log level on stderr (default: error)",
    )
    return common


# --- plumbing ---------------------------------------------------------------------------------


def _guarded(handler):
    """Run a handler with logging on stderr; ground errors become one-line CLI errors."""

    def run(args) -> int:
        log.setup(level=args.log_level, stream=sys.stderr, component="ground")
        try:
            _check_numbers(args)
            return handler(args) or EXIT_OK
        except GroundError as exc:
            raise CliError(str(exc), exc.exit_code) from None

    return run


#: numeric options (where a command has them) and what each must be; a bad value is a local input
#: error (exit 5) before the link opens: a non-finite timeout would reach ZeroMQ's poll as a number
#: it cannot convert, a negative poll interval would ask the payload again without pause
_NUMBERS = (
    ("timeout", "--timeout", {"above": 0}),
    ("handshake_timeout", "--handshake-timeout", {"above": 0}),
    ("max_wait", "--max-wait", {"above": 0}),
    ("poll", "--poll", {"above": 0}),
    ("duration", "--duration", {"above": 0}),
    ("since", "--since", {"at_least": 0}),
)


def _check_numbers(args) -> None:
    for name, flag, bounds in _NUMBERS:
        check_number(getattr(args, name, None), flag, error=LocalInputError, **bounds)


def _keys_dir(args) -> str:
    return args.keys or os.environ.get("OW_KEYS_DIR") or "keys"


def _notify(text: str) -> None:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from tqdm import tqdm

    tqdm.write(f"ow ground: {display_text(text)}", file=sys.stderr)
    sys.stderr.flush()


def _client(args, **overrides):
    """The command's GroundClient; `overrides` are GroundOptions fields (the console's per action),
    put in with dataclasses.replace, which checks them as the options' constructor does."""
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from dataclasses import replace

    from ground.client import GroundClient, GroundOptions

    endpoints = Endpoints.from_env()
    endpoints = Endpoints(commands=args.commands_endpoint, payload=endpoints.payload, telemetry=args.telemetry_endpoint)
    options = GroundOptions(
        station=args.station,
        source_id=args.source_id,
        endpoints=endpoints,
        state_dir=args.state_dir,
        timeout_s=args.timeout,
        handshake_timeout_s=args.handshake_timeout,
        notify=_notify,
        # the command log says who sent each command: `ow ground uplink`, `ow ground console`...
        origin=f"ow ground {getattr(args, 'ground_command', None) or 'client'}",
    )
    return GroundClient(_keys_dir(args), replace(options, **overrides))


def _print_json(data) -> None:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.report import json_text

    print(json_text(data), flush=True)


# --- commands ---------------------------------------------------------------------------------


def cmd_keys_init(args) -> int:

    root = _keys_dir(args)
    clients = list(dict.fromkeys([*DEFAULT_CLIENTS, args.station, *args.client, *args.admin]))
    before = KeyLayout(Path(root))
    existed = {name: before.client_secret(name).exists() for name in clients}
    server_existed = before.server_secret.exists()
    try:
        layout = init_keys(root, tuple(clients), force=args.force, admins=tuple(args.admin))
    except WireError as exc:
        raise LocalInputError(f"client name: {exc.reason}") from None
    except ValueError as exc:
        raise LocalInputError(f"station binding: {exc}") from None
    except OSError as exc:
        raise LocalInputError(f"cannot create keys in {root}: {exc.strerror or exc}") from None
    bound = station_bindings(layout)

    def state(existed_before: bool) -> str:
        return "replaced" if existed_before and args.force else ("kept" if existed_before else "created")

    if args.json:
        _print_json(
            {
                "keys_dir": str(layout.root.resolve()),
                "server": {
                    "public": str(layout.server_public),
                    "secret": str(layout.server_secret),
                    "state": state(server_existed),
                },
                "clients": {
                    n: {
                        "public": str(layout.client_public(n)),
                        "secret": str(layout.client_secret(n)),
                        "state": state(existed[n]),
                    }
                    for n in clients
                },
                "authorized": [str(layout.authorized_dir / f"{n}.key") for n in clients],
                "bindings": {n: {"source_id": sid, "role": _role(sid)} for n, sid in bound.items()},
                "state_dir": str(layout.state_dir),
            }
        )
        return 0
    r = layout.root
    print(display_text(f"keys in {layout.root.resolve()}"))
    print(
        f"  bus server pair   {layout.server_public.relative_to(r)}, {layout.server_secret.relative_to(r)} "
        f"({state(server_existed)})"
    )
    for n in clients:
        print(
            f"  client {n:<10} {layout.client_public(n).relative_to(r)}, {layout.client_secret(n).relative_to(r)} "
            f"({state(existed[n])})"
        )
    print(f"  bus admits        {', '.join(str((layout.authorized_dir / f'{n}.key').relative_to(r)) for n in clients)}")
    print(
        "  stations          "
        + ", ".join(f"{n} {sid:#06x} ({_role(sid)})" for n, sid in bound.items() if n in clients)
        + f" in {layout.authorized_dir.relative_to(r)}/<name>.station"
    )
    print(f"  ground state      {layout.state_dir.relative_to(r)}/")
    print("where each file goes:")
    print(f"  bus:      {layout.server_dir.relative_to(r)}/ (both files) and {layout.authorized_dir.relative_to(r)}/")
    print(
        f"  payload:  {layout.client_secret('payload').relative_to(r)}, "
        f"{layout.client_public('payload').relative_to(r)} "
        f"and {layout.server_public.relative_to(r)}"
    )
    print(
        f"  ground:   {layout.client_secret(args.station).relative_to(r)}, "
        f"{layout.client_public(args.station).relative_to(r)}, "
        f"{layout.client_binding_path(args.station).relative_to(r)}, "
        f"{layout.server_public.relative_to(r)} and {layout.state_dir.relative_to(r)}/"
    )
    print("  secret keys (*.key_secret) never leave the machine they belong to")
    return 0


def _role(source_id: int) -> str:
    return "admin" if is_admin_source(source_id) else "station"


def cmd_keys_authorize(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.images import check_operator_name

    layout = KeyLayout(Path(_keys_dir(args)))
    public = Path(args.public_key) if args.public_key else layout.client_public(args.name)
    existing = layout.authorized_dir / f"{args.name}.key"
    if args.public_key is None and not public.exists() and existing.exists():
        public = existing  # already admitted: bind it
    if args.admin and args.source_id is not None and not is_admin_source(args.source_id):
        raise LocalInputError(f"--admin with source id {args.source_id:#06x}: admin ids are 0x0001..0x000F")
    source_id = args.source_id
    if source_id is None and not args.admin:
        try:
            source_id = read_binding(layout.binding_path(args.name))  # kept as it is
        except ValueError:
            source_id = None  # a damaged binding is replaced
    admin = args.admin or (source_id is not None and is_admin_source(source_id))
    try:
        check_operator_name(args.name, "station name")
        if not public.exists():
            raise LocalInputError(f"public key {public}: no such file (give --public-key FILE)")
        authorize_client(layout, args.name, public)
        binding = bind_station(layout, args.name, source_id, admin=admin)
    except ValueError as exc:
        raise LocalInputError(str(exc)) from None
    except OSError as exc:
        raise LocalInputError(f"cannot authorize {args.name} in {layout.root}: {exc.strerror or exc}") from None
    if args.json:
        _print_json({"name": binding.name, "source_id": binding.source_id, "role": binding.role})
    else:
        print(
            f"{display_text(binding.name)}: admitted, source id {binding.source_id:#06x} ({binding.role})", flush=True
        )
    return 0


def cmd_keys_revoke(args) -> int:
    layout = KeyLayout(Path(_keys_dir(args)))
    key = layout.authorized_dir / f"{args.name}.key"
    if not key.exists():
        raise LocalInputError(f"{key}: no such key; nothing to revoke")
    try:
        # The key first: from then on no handshake succeeds and the bus closes what is open.
        key.unlink()
        layout.binding_path(args.name).unlink(missing_ok=True)
    except OSError as exc:
        raise LocalInputError(f"cannot revoke {args.name}: {exc.strerror or exc}") from None
    if args.json:
        _print_json({"name": args.name, "revoked": True})
    else:
        print(f"{display_text(args.name)}: revoked (the bus closes its connections within a second)", flush=True)
    return 0


def cmd_keys_list(args) -> int:
    layout = KeyLayout(Path(_keys_dir(args)))
    names = sorted(p.stem for p in layout.authorized_dir.glob("*.key"))
    bound = station_bindings(layout)
    rows = [
        {
            "name": n,
            "source_id": bound.get(n),
            "role": _role(bound[n]) if n in bound else ("payload" if n == PAYLOAD_CLIENT else "unbound"),
        }
        for n in names
    ]
    if args.json:
        _print_json(rows)
        return 0
    for row in rows:
        sid = f"{row['source_id']:#06x}" if row["source_id"] is not None else "-"
        # key names are file names found on disk: shown with anything hidden made visible
        print(f"{display_text(str(row['name'])):<16} {sid:<7} {row['role']}", flush=True)
    return 0


def cmd_uplink(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.images import check_chunk_bytes

    if args.window < 1 or args.retries < 0:
        raise LocalInputError("--window must be >= 1 and --retries >= 0")
    check_chunk_bytes(args.chunk_bytes)
    client = _client(
        args, retries=args.retries, window=args.window, chunk_bytes=args.chunk_bytes, progress=args.progress
    )
    # Everything local is checked before the link is even opened: bad input sends nothing.
    _precheck_uplink(client, args)
    with client:
        result = client.uplink(
            args.image,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            priority=args.priority,
            task_id=args.task_id,
            new_task=args.new_task,
        )
    for image in result.images:
        resumed = f", resumed {image.resumes} time(s)" if image.resumes else ""
        _notify(
            f"image {image.name} ({image.path}): {image.chunks} chunk(s), {image.held_before} already on board, "
            f"{image.chunks_sent} sent{resumed}; verified on board"
        )
    state = (client.state.task(result.task_id) or {}).get("state")
    if state in ("completed", "failed", "cancelled"):
        _notify(f"task {result.task_id} accepted again by the payload; it is already {state} (nothing new queued)")
    elif result.reused_task_id:
        _notify(f"task {result.task_id} accepted again by the payload (the same task; nothing new queued)")
    else:
        _notify(f"task {result.task_id} accepted by the payload (queued)")
    if args.json:
        _print_json(result.to_dict())
    else:
        print(result.task_id, flush=True)
    return 0


def _precheck_uplink(client, args) -> None:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.images import check_max_new_tokens, check_operator_name, check_priority, check_prompt, prepare_images

    check_prompt(args.prompt)
    check_max_new_tokens(args.max_new_tokens)
    check_priority(args.priority)
    if args.task_id is not None:
        check_operator_name(args.task_id, "task id")
    prepare_images(args.image)


def _check_task_id(task_id: str) -> None:
    """A task id typed by the operator, checked before the link opens (exit 5, nothing sent)."""
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.images import check_operator_name

    check_operator_name(task_id, "task id")


#: What argparse takes for a value though it starts with "-": a negative number (its own rule), or a
#: FROM,TO pair with a negative FROM (checked by _off_period).
_NEGATIVE_NUMBER_OR_PAIR = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\.?\d[^,]*,")


def _off_period(text: str) -> tuple[float, float]:
    """--off FROM,TO: seconds from now, TO after FROM."""
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give FROM,TO in seconds from now (e.g. --off 600,900; before now: --off -3000,-2600)"
        ) from None
    if not (math.isfinite(a) and math.isfinite(b)) or b <= a:
        raise argparse.ArgumentTypeError(f"{text!r}: TO must be a number after FROM")
    return a, b


#: The completion forecast's options, shared by `status` and `results`.
_FORECAST_ARGS = (
    arg(
        "--plan",
        metavar="FILE",
        help="forecast on these power windows (a trace file, docs/trace-format.md: eclipse times, contact plan, "
        "expected duty cycle) instead of resampling the payload's window history",
    ),
    arg(
        "--plan-scale",
        type=float,
        default=1.0,
        metavar="X",
        help="with --plan: wall seconds per plan second (default 1); the plan's second 0 is now",
    ),
    arg(
        "--off",
        action="append",
        default=[],
        type=_off_period,
        metavar="FROM,TO",
        help="a period the payload is known to be off, in seconds from now (negative: in the past, e.g. "
        "--off -3000,-2600): a contact plan's pass, a higher-priority payload's scheduled window; repeatable. "
        "The resampled windows are cut around it, and the history's gaps it explains are not drawn again as "
        "random ones",
    ),
)


def _allow_negative_pairs(parser: argparse.ArgumentParser) -> None:
    # argparse takes a value starting with "-" for an option unless it looks like one negative
    # number; FROM,TO pairs with a negative FROM are values too (this parser has no option that
    # looks like a number)
    parser._negative_number_matcher = _NEGATIVE_NUMBER_OR_PAIR


def _forecast(args) -> dict:
    """The completion forecast of this station's open tasks (ground/forecast.py)."""
    from common.sim.windows import trace_windows  # lazy, as above
    from ground.forecast import forecast_tasks
    from ground.state import GroundState

    state = GroundState(args.state_dir or KeyLayout(Path(_keys_dir(args))).state_dir)
    now = time.time()
    plan = None
    if getattr(args, "plan", None):
        import traces

        try:
            windows, _ = trace_windows(traces.load(args.plan))
        except Exception as exc:  # noqa: BLE001 - any unreadable plan: say which and why
            raise LocalInputError(f"--plan {args.plan}: {exc}") from None
        if args.plan_scale <= 0:
            raise LocalInputError("--plan-scale must be above 0")
        # plan second 0 is now: shift into Unix seconds after the scale
        plan = [(now / args.plan_scale + a, now / args.plan_scale + b) for a, b in windows]
    off = [(now + a, now + b) for a, b in getattr(args, "off", None) or []]
    tasks = state.tasks() if state.tasks_path.exists() else []
    return forecast_tasks(
        tasks, state.forecast_basis(), plan=plan, plan_scale=args.plan_scale, known_off=off, now_wall=now
    )


def cmd_status(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.forecast import forecast_lines
    from ground.report import housekeeping_text, to_jsonable

    with _client(args) as client:
        hk = client.status()
    forecast = _forecast(args)
    if args.json:
        _print_json(dict(to_jsonable(hk), forecast=forecast))
    else:
        print(housekeeping_text(hk), flush=True)
        print("\n".join(forecast_lines(forecast)), flush=True)
    return 0


def cmd_results(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.report import result_json, result_text, tasks_table

    if args.task is None:
        from ground.state import GroundState  # lazy: numpy; `ow --help` imports this module

        state = GroundState(args.state_dir or KeyLayout(Path(_keys_dir(args))).state_dir)
        tasks = state.tasks() if state.tasks_path.exists() else []
        if args.json:
            _print_json(tasks)
        else:
            print(tasks_table(tasks), flush=True)
        return 0
    _check_task_id(args.task)
    forecast = None
    if args.wait:
        from ground.forecast import forecast_lines  # lazy, as above

        forecast = _forecast(args)
        mine = {"tasks": {k: v for k, v in forecast.get("tasks", {}).items() if k == args.task}}
        for line in forecast_lines(forecast if "unavailable" in forecast else mine):
            _notify(line)
    with _client(args) as client:
        result = client.result(args.task, wait=args.wait, max_wait_s=args.max_wait, poll_s=args.poll)
    if args.json:
        _print_json(result_json(result) if forecast is None else dict(result_json(result), forecast=forecast))
    else:
        print(result_text(result), flush=True)
    return 0


def cmd_events(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.report import RoutineFilter, archived_line, describe, packet_line, packet_record
    from ground.state import file_lock

    client = _client(args, commands=False)
    state = client.state
    state.ensure()
    printed: set[str] = set()
    routine = None if args.all or args.json else RoutineFilter()  # --json: every packet, for programs

    def show_entry(entry: dict) -> None:
        if entry.get("type") == "HEARTBEAT" and not args.heartbeats:
            return
        if routine is not None and not routine.show_entry(entry):
            return
        printed.add(entry.get("digest", ""))
        if args.json:
            _print_json(entry)
        else:
            print(archived_line(entry), flush=True)

    with client, file_lock(state.recorder_lock_path, blocking=False) as recording:
        number = state.last_archived_number() if recording else None
        if args.since is not None:
            # The live subscription is already up, so nothing falls between archive and live.
            for entry in state.archived(args.since):
                show_entry(entry)
        try:
            for packet in client.telemetry(None if args.follow else args.duration):
                if packet.digest in printed:
                    continue
                if number is not None:
                    number += 1
                    record = packet_record(packet, number)
                    record["text"] = describe(packet.message)
                    state.append_archive(json.dumps(record, ensure_ascii=False))
                if packet.message.TYPE.name == "HEARTBEAT" and not args.heartbeats:
                    continue
                if routine is not None and not routine.show_packet(packet):
                    continue  # archived above: only the printing is spared
                if args.json:
                    record = packet_record(packet, number)
                    _print_json(record)
                else:
                    print(packet_line(packet, number), flush=True)
        except KeyboardInterrupt:
            return 0  # Ctrl-C is how --follow ends
    return 0


def cmd_ping(args) -> int:
    if args.count < 1:
        raise LocalInputError("--count must be >= 1")
    with _client(args) as client:
        for i in range(args.count):
            if i:
                time.sleep(1.0)
            rtt = client.ping()
            if args.json:
                _print_json({"rtt_ms": round(rtt * 1000, 3)})
            else:
                print(f"PONG from payload: {rtt * 1000:.1f} ms", flush=True)
    return 0


def cmd_payload_retry(args) -> int:
    with _client(args) as client:
        client.payload_retry()
    if args.json:
        _print_json({"payload_retry": "completed"})
    else:
        print("bus: boot-loop hold released; the payload is powered again as the trace allows", flush=True)
    return 0


def cmd_cancel(args) -> int:
    _check_task_id(args.task)
    with _client(args) as client:
        client.cancel(args.task)
    if args.json:
        _print_json({"task_id": args.task, "cancelled": True})
    else:
        print(f"task {args.task}: cancel accepted and completed", flush=True)
    return 0


def cmd_priority(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.images import check_priority

    _check_task_id(args.task)
    check_priority(args.priority)
    with _client(args) as client:
        client.set_priority(args.task, args.priority)
    if args.json:
        _print_json({"task_id": args.task, "priority": args.priority})
    else:
        print(f"task {args.task}: priority set to {args.priority}", flush=True)
    return 0


def cmd_quarantine(args) -> int:
    with _client(args) as client:
        if args.release:
            client.release(args.release)
            if args.json:
                _print_json({"released": args.release})
            else:
                print(display_text(f"{args.release}: released from quarantine"), flush=True)
            return 0
        listing = client.quarantine()
    if args.json:
        _print_json(
            {
                "total": listing.total,
                "items": [
                    {"item": i, "exits": n, "reason": r}
                    for i, n, r in zip(listing.items, listing.exits, listing.reasons, strict=True)
                ],
            }
        )
    elif not listing.items:
        print("nothing quarantined", flush=True)
    else:
        for item, exits, reason in zip(listing.items, listing.exits, listing.reasons, strict=True):
            print(display_text(f"{item}  {exits} exit(s)  {reason}"), flush=True)
        if listing.total > len(listing.items):
            print(f"... {listing.total - len(listing.items)} more", flush=True)
    return 0


def cmd_lost(args) -> int:
    with _client(args) as client:
        lost = client.lost_tasks()
    if args.json:
        _print_json(
            {
                "task_ids": list(lost.task_ids),
                "total": lost.total,
                "bytes_dropped": lost.bytes_dropped,
                "records_dropped": lost.records_dropped,
                "unnamed": lost.unnamed,
            }
        )
    else:
        print(f"{lost.total} task(s) lost: {', '.join(lost.task_ids) or '-'}", flush=True)
        print(
            f"journal reader skipped {lost.bytes_dropped} damaged bytes in {lost.records_dropped} region(s); "
            f"{lost.unnamed} region(s) named no task",
            flush=True,
        )
    return 0


def cmd_resend(args) -> int:
    _check_task_id(args.task)
    with _client(args, progress=None) as client:
        result = client.resend(args.task)
    if args.json:
        _print_json(result.to_dict())
    else:
        sent = sum(i.chunks_sent for i in result.images)
        print(f"task {result.task_id}: images on board ({sent} chunk(s) sent again), task re-sent", flush=True)
    return 0


def cmd_commands(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.console.command_log import CommandLogReader, command_line, parse_since
    from ground.state import GroundState

    since = None
    if args.since_when is not None:
        try:
            since = parse_since(args.since_when)
        except ValueError as exc:
            raise LocalInputError(f"--since: {exc}") from None
    if args.last is not None and args.last < 1:
        raise LocalInputError(f"--last must be >= 1, not {args.last}")
    state = GroundState(args.state_dir or KeyLayout(Path(_keys_dir(args))).state_dir)
    reader = CommandLogReader(state.command_log_path)

    def show(entries: list[dict]) -> None:
        for entry in entries:
            if args.json:
                _print_json(entry)
            else:
                print(command_line(entry), flush=True)

    def wanted(entries: list[dict]) -> list[dict]:
        if since is None:
            return entries
        return [e for e in entries if isinstance(e.get("t"), int | float) and e["t"] >= since]

    damaged = 0

    def count_damaged() -> None:
        nonlocal damaged
        if reader.damaged > damaged:
            _notify(f"skipped {reader.damaged - damaged} damaged line(s) of the command log")
            damaged = reader.damaged

    try:
        if not state.command_log_path.exists() and not reader.rotated.exists():
            _notify(f"no command logged yet ({state.command_log_path} does not exist)")
        backlog = wanted(reader.backlog())
        show(backlog[-args.last :] if args.last else backlog)
        count_damaged()
        while args.follow:
            time.sleep(0.5)  # a few lines a second at most: a log, not a stream
            show(wanted(reader.new()))
            count_damaged()
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how --follow ends
    finally:
        reader.close()
    return 0


def cmd_console(args) -> int:
    # lazy: `ow --help` imports this module; the subcommand's own modules load when it runs
    from ground.console import ConsoleConfig, ConsoleSecurity, History, SecurityError
    from ground.console.security import is_loopback, read_token_file, self_signed
    from ground.console.server import run
    from ground.state import GroundState

    if not 0 <= args.port <= 65535:
        raise LocalInputError("--port must be 0..65535")
    if args.max_events < 1:
        raise LocalInputError("--max-events must be >= 1")
    try:
        token = read_token_file(args.token_file) if args.token_file else args.token
        # Actions need a token on loopback too (any local program could post to the port): one is
        # made for this run when none is given, and the announced address carries it. Beyond
        # loopback the operator must give one (check_startup refuses to start without).
        made_token = not token and not args.read_only and is_loopback(args.host)
        if made_token:
            token = secrets.token_urlsafe(24)
        cert, key = args.tls_cert, args.tls_key
        if bool(cert) != bool(key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if args.tls_self_signed and not cert:
            cert, key, fingerprint = self_signed(args.tls_self_signed, args.host)
            _notify(f"self-signed TLS certificate {cert}, SHA-256 fingerprint {fingerprint}")
        security = ConsoleSecurity(host=args.host, token=token, read_only=args.read_only, tls_cert=cert, tls_key=key)
        security.check_startup()
    except SecurityError as exc:
        raise LocalInputError(str(exc)) from None
    state = GroundState(args.state_dir or KeyLayout(Path(_keys_dir(args))).state_dir)
    config = ConsoleConfig(
        client_factory=lambda **overrides: _client(args, **overrides),
        security=security,
        station=args.station,
        state=state,
        history=History(max_events=args.max_events),
    )
    run(config, args.port, announce=_notify, token_in_url=made_token)
    return 0


# --- the command line, declared -------------------------------------------------------------

#: `ow ground keys ...` (common/cliargs.py).
KEY_COMMANDS: tuple[Command, ...] = (
    Command(
        "init",
        help="create the key layout (bus server pair, client pairs, authorized keys, state/)",
        handler=cmd_keys_init,
        description="Create the keys directory: the bus's server key pair, one client key pair per station "
        "(ground, payload, and any --client), the bus's list of authorized public keys, and state/. "
        "Existing pairs are kept unless --force. Prints which file goes where.",
        args=(
            arg(
                "--force",
                action="store_true",
                help="replace existing key pairs (every client then needs the new bus key)",
            ),
            arg(
                "--client",
                action="append",
                default=[],
                metavar="NAME",
                help="another station: a client key pair, authorized and bound to the next free station source id "
                "(0x0010..0x00FF: it acts on its own tasks only)",
            ),
            arg(
                "--admin",
                action="append",
                default=[],
                metavar="NAME",
                help="another admin station: as --client, bound to the next free admin source id (0x0002..0x000F: "
                "it may act on every station's tasks)",
            ),
        ),
    ),
    Command(
        "authorize",
        help="admit a station's public key and bind it to a source id",
        handler=cmd_keys_authorize,
        description="Admit station NAME: copy its public key (--public-key FILE, default clients/NAME.key) to "
        "authorized/NAME.key and bind it to a source id in authorized/NAME.station (--source-id N, or the next "
        "free station id, or with --admin the next free admin id). An existing binding of NAME is kept unless "
        "another id is asked for. The bus reads both at once, without a restart. Also binds a key authorized "
        "before bindings existed.",
        args=(
            arg("name", metavar="NAME", help="the station's key name"),
            arg("--public-key", metavar="FILE", default=None, help="the station's public key file (.key)"),
            arg(
                "--admin",
                action="store_true",
                help="bind to an admin source id (0x0001..0x000F) instead of a station's",
            ),
        ),
    ),
    Command(
        "revoke",
        help="stop admitting a station's key",
        handler=cmd_keys_revoke,
        description="Remove authorized/NAME.key and its binding: the bus refuses the key's next packet "
        "(NOT_AUTHORIZED), closes its open connections within a second and publishes KEY_REVOKED; new "
        "connections with the key fail the handshake.",
        args=(arg("name", metavar="NAME", help="the station's key name"),),
    ),
    Command(
        "list",
        help="the keys the bus admits and their source ids",
        handler=cmd_keys_list,
        description="List authorized/: each key name, the source id it is bound to and its role (admin or "
        "station), `payload` (the payload link's key), or `unbound` (the bus refuses its commands with "
        "SOURCE_NOT_BOUND until `ow ground keys authorize NAME` binds it).",
    ),
)

#: `ow ground ...`: the station's commands (common/cliargs.py).
GROUND_COMMANDS: tuple[Command, ...] = (
    Command(
        "uplink",
        help="upload images and queue an inference task",
        handler=cmd_uplink,
        description="Check the images and prompt locally, upload each image in chunks (only the chunks the "
        "payload does not "
        "hold: IMAGE_QUERY first, CRC-32C per chunk, SHA-256 per file), then queue the task with UPLINK_TASK and "
        "wait until the payload accepts it. If answers stop (link loss, bus restart, payload power cut) the upload "
        "re-queries and resumes; running the same command again resumes too and reuses the task id, so no chunk "
        "held on board is sent twice and no task is queued twice. Prints the task id.",
        args=(
            arg(
                "--image",
                action="append",
                required=True,
                metavar="FILE",
                help="picture file (PNG, JPEG, ...; <= 16 MiB); repeat for several (<= 8)",
            ),
            arg("--prompt", required=True, metavar="TEXT", help="the question about the images (UTF-8, <= 8192 bytes)"),
            arg(
                "--max-new-tokens", type=int, default=64, metavar="N", help="tokens to generate, 1..1024 (default: 64)"
            ),
            arg("--priority", type=int, default=0, metavar="P", help="0..255, higher runs first (default: 0)"),
            arg(
                "--task-id", metavar="ID", help="task id (default: generated, or the id of an identical earlier uplink)"
            ),
            arg(
                "--new-task", action="store_true", help="queue a new task even if an identical one was uplinked before"
            ),
            arg(
                "--chunk-bytes", type=int, default=32 * 1024, metavar="B", help="image bytes per chunk (default: 32768)"
            ),
            arg(
                "--window",
                type=int,
                default=8,
                metavar="N",
                help="chunks in flight before waiting for acknowledgements (default: 8)",
            ),
            arg(
                "--retries",
                type=int,
                default=12,
                metavar="N",
                help="unanswered rounds (of --timeout each) tolerated before giving up with exit 4 (default: 12)",
            ),
            Group(
                (
                    arg(
                        "--progress",
                        dest="progress",
                        action="store_true",
                        default=None,
                        help="always show the progress bar",
                    ),
                    arg("--no-progress", dest="progress", action="store_false", help="never show the progress bar"),
                ),
                exclusive=True,
            ),
        ),
    ),
    Command(
        "status",
        help="payload housekeeping now, and when each open task should be done",
        handler=cmd_status,
        description="Send STATUS and print the payload's housekeeping: queue depth, current task and its "
        "progress, checkpoint "
        "bytes, free disk, bytes written to data storage since this boot (wear), resident memory, boot count, uptime, "
        "command and error counters. Then the completion forecast of every "
        "task of this station still queued or running: expected time, 10-90 % band and the power windows still to "
        "come before it is done, from the payload's measured rates and the windows it has lived through "
        '(docs/ground.md), or why there is none. --json adds it under "forecast".',
        setup=_allow_negative_pairs,
        args=(*_FORECAST_ARGS,),
    ),
    Command(
        "results",
        help="fetch a task's result, or list this station's tasks",
        handler=cmd_results,
        description="With TASK: send DOWNLINK_RESULT and print the generated text, token count, timings, the "
        "power cuts the task survived, each restart (its time to resume, the phase it resumed in, its recovery "
        "plan) and the checkpoint bytes the task wrote over every boot (saved under <state>/results/). "
        "--wait waits for the task to finish (progress on stderr). "
        "Without TASK: list the tasks uplinked from this station and their last known state.",
        setup=_allow_negative_pairs,
        args=(
            arg("task", nargs="?", metavar="TASK", help="task id"),
            arg(
                "--wait",
                action="store_true",
                help="wait until the task completes (or fails) instead of exit 3 RESULT_NOT_READY",
            ),
            arg(
                "--max-wait",
                type=float,
                default=None,
                metavar="S",
                help="with --wait: give up (exit 4) after S seconds (default: never)",
            ),
            arg(
                "--poll",
                type=float,
                default=30.0,
                metavar="S",
                help="with --wait: ask again every S seconds (default: 30)",
            ),
            *_FORECAST_ARGS,
        ),
    ),
    Command(
        "events",
        help="watch telemetry: events, reports, power, thermal, FDIR",
        handler=cmd_events,
        description="Subscribe to the bus's telemetry and print one line per packet: events with severity, "
        "verification reports "
        "(ACCEPTED, REJECTED with code, PROGRESS, ...), housekeeping, power, thermal, FDIR, shutdown warnings, power "
        "state. Heartbeats only with --heartbeats; the bus's once-a-second FDIR, POWER and THERMAL reports only when "
        "they change or once a minute (--all: every one). While it runs it archives every packet to "
        "<state>/telemetry.jsonl with a number (#n) (one recorder at a time); --since N first replays archived "
        "packets after #N.",
        args=(
            arg("--follow", action="store_true", help="keep printing until Ctrl-C"),
            arg(
                "--duration",
                type=float,
                default=10.0,
                metavar="S",
                help="without --follow: listen for S seconds (default: 10)",
            ),
            arg("--since", type=int, default=None, metavar="N", help="first print archived packets numbered above N"),
            arg("--heartbeats", action="store_true", help="also print HEARTBEAT packets"),
            arg(
                "--all",
                action="store_true",
                help="print every routine report too: without it an FDIR report is printed when its mode or faults "
                "change, a POWER report when the payload's power state changes or once a minute, a THERMAL report "
                "once a minute (the bus sends each every second; the archive keeps them all)",
            ),
        ),
    ),
    Command(
        "quarantine",
        help="list quarantined items, or release one",
        handler=cmd_quarantine,
        description="Without ITEM: send LIST_QUARANTINE and print the commands, tasks and reports the payload "
        "holds back "
        "because boots ended abnormally (or their handler failed) while handling them, with the count and "
        "the last reason. With --release ITEM: send RELEASE_QUARANTINE; a task is queued again, a report "
        "sent again, a command handled the next time it arrives.",
        args=(
            arg(
                "--release", metavar="ITEM", help="item id as listed (task:<id>, report:<id>, command:<TYPE>:<digest>)"
            ),
        ),
    ),
    Command(
        "lost",
        help="list tasks the payload lost to storage damage",
        handler=cmd_lost,
        description="Send LIST_LOST_TASKS and print the tasks whose state the payload's journal or result store "
        "lost (a bit "
        "flip, a damaged file), and how many damaged bytes its reader skipped. A lost task that never finished "
        "can be sent again with `ow ground resend TASK`; a finished one answers TASK_LOST.",
    ),
    Command(
        "resend",
        help="upload a task's images again and re-send the task",
        handler=cmd_resend,
        description="For a task uplinked from this station: upload its images where the payload no longer holds "
        "them (an "
        "image found damaged on board: IMAGE_CORRUPT) and send the same UPLINK_TASK again (the payload takes "
        "it once). Uses the image files recorded at uplink.",
        args=(arg("task", metavar="TASK"),),
    ),
    Command(
        "payload-retry",
        help="power the payload again after the bus's boot-loop hold",
        handler=cmd_payload_retry,
        description="Send PAYLOAD_RETRY to the bus itself (APID BUS; an admin station's command, source id 1..15). "
        "The bus holds the payload off -- power off whatever the trace says -- after it failed to come up "
        "--boot-loop-limit times in a row (it exited or was killed before it had been up --boot-settle s, "
        "or never connected), and says so with a PAYLOAD_BOOT_LOOP event naming the reason the last boot "
        "gave (`ow ground events`; the FDIR report shows mode safe meanwhile). Fix the cause (a model "
        "directory, a key, a memory limit), then send this: the bus answers ACCEPTED and COMPLETED, sends "
        "a PAYLOAD_RETRY event and powers the payload again as the trace allows; one more failed boot "
        "holds it again. The hold also ends by itself after the bus's back-off. Exit 3 with NOT_HELD when "
        "nothing is held.",
    ),
    Command(
        "ping",
        help="PING the payload, print the round-trip time",
        handler=cmd_ping,
        description="Send PING and wait for the PONG with the same key.",
        args=(arg("--count", type=int, default=1, metavar="N", help="pings to send, one per second (default: 1)"),),
    ),
    Command(
        "cancel",
        help="cancel a queued or running task",
        handler=cmd_cancel,
        description="Send CANCEL_TASK and wait for ACCEPTED and COMPLETED; the task then ends with FAILED(CANCELLED).",
        args=(arg("task", metavar="TASK"),),
    ),
    Command(
        "priority",
        help="change a queued task's priority",
        handler=cmd_priority,
        description="Send SET_PRIORITY and wait for ACCEPTED and COMPLETED.",
        args=(
            arg("task", metavar="TASK"),
            arg("priority", type=int, metavar="P", help="0..255, higher runs first"),
        ),
    ),
    Command(
        "commands",
        help="print the station's command log: every command sent, its answer and round trip",
        handler=cmd_commands,
        description="Print the station's command log (<state>/commands.jsonl, docs/ground.md "
        '"Command log"): every command '
        "any `ow ground` process of this station sent (the console included), oldest first, one line each: when "
        "it was first sent (UTC), the command and what it named, the round trip, who sent it, and the answer "
        "(OK, or the code, who answered and the reason; NO_ANSWER). Reads the local log only: no link is opened.",
        args=(
            arg(
                "--since",
                dest="since_when",
                metavar="WHEN",
                default=None,
                help="only commands sent at or after WHEN: a UTC time (2026-12-05, 2026-12-05T11:30, "
                "2026-12-05T11:30:00Z) "
                "or an age before now (90s, 15m, 2h, 1d)",
            ),
            arg("--last", type=int, default=None, metavar="N", help="only the newest N of them"),
            arg("--follow", action="store_true", help="then print each command as it is logged, until Ctrl-C (exit 0)"),
        ),
    ),
    Command(
        "console",
        help="serve the web console for operators (timeline, tasks, events, telemetry, uplink)",
        handler=cmd_console,
        description='Serve a live web console (docs/ground.md "Console"): pass timeline, tasks with their '
        "actions, events "
        "and command history, telemetry plots with CSV export, and uplink. It is a ground client like these "
        "commands, with the station's keys. On loopback by default; bound beyond loopback it refuses to start "
        "without --token/--token-file and TLS (--tls-cert/--tls-key, or --tls-self-signed DIR, whose SHA-256 "
        "fingerprint it prints). Serves until Ctrl-C.",
        args=(
            arg("--host", default="127.0.0.1", metavar="ADDR", help="address to listen on (default: 127.0.0.1)"),
            arg(
                "--port",
                type=int,
                default=8765,
                metavar="N",
                help="port (default: 8765; 0 picks a free one, and the address announced names it)",
            ),
            arg("--token", default=None, metavar="TEXT", help="token that actions need (header X-Console-Token)"),
            arg("--token-file", default=None, metavar="FILE", help="read the token from FILE (first line)"),
            arg("--tls-cert", default=None, metavar="PEM", help="TLS certificate (with --tls-key)"),
            arg("--tls-key", default=None, metavar="PEM", help="TLS private key (with --tls-cert)"),
            arg(
                "--tls-self-signed",
                default=None,
                metavar="DIR",
                help="make (or reuse) a self-signed certificate in DIR and print its SHA-256 fingerprint",
            ),
            arg("--read-only", action="store_true", help="serve the views only: every action is refused"),
            arg(
                "--max-events",
                type=int,
                default=100_000,
                metavar="N",
                help="events the console keeps (default: 100000)",
            ),
        ),
    ),
)


def register(subparsers) -> None:
    # Built when the parser is: their defaults come from the environment ($OW_*_ENDPOINT).
    common = _common_options()
    ground = subparsers.add_parser(
        "ground",
        help="ground station: keys, uplink, status, results, telemetry",
        description="Ground station tools: command the payload through the bus over CurveZMQ, upload images "
        "in resumable chunks, queue tasks, fetch results, watch telemetry.",
        epilog=_EPILOG,
    )
    sub = ground.add_subparsers(dest="ground_command", metavar="ACTION")
    sub.required = True
    keys = sub.add_parser(
        "keys", help="create CurveZMQ keys", description="Manage the CurveZMQ keys of the ground link.", epilog=_EPILOG
    )
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION")
    keys_sub.required = True
    add_commands(keys_sub, KEY_COMMANDS, _guarded, parents=(common,), epilog=_EPILOG)
    add_commands(sub, GROUND_COMMANDS, _guarded, parents=(common,), epilog=_EPILOG)
