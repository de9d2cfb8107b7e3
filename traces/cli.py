"""Trace commands: `trace-info`, `trace-validate`, `trace-generate`, `trace-import-csv`,
`trace-import-bupt1` and `trace-regenerate`. `register_trace_commands(subparsers)` adds them to
any argparse subparsers object (`ow hil` uses it); `python -m traces COMMAND ...` runs them
stand-alone.

Each command returns an exit status; user errors raise `common.cli.CliError` (one line, no
traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from common.cliargs import Command, add_commands, arg
from common.errors import CliError, check_number
from traces.catalog import DATA_DIR, GENERATED_NAMES, SHIPPED_NAMES, SUFFIX, resolve, resolve_quiet
from traces.format import TraceError, dump, dumps, load, validate
from traces.importers.bupt1 import Bupt1DataError, Bupt1Import, import_bupt1, import_bupt1_reported
from traces.importers.csv_import import (
    BATTERY_UNITS,
    CURRENT_UNITS,
    TIME_UNITS,
    VOLTAGE_UNITS,
    CsvImport,
    CsvImportError,
    CsvImportOptionsError,
    import_csv,
)
from traces.presets import PRESETS, SHIPPED_SEEDS, generate


def _cli_error(message: str, code: int = 2) -> Exception:
    return CliError(message, code)


def _load(trace_arg: str):
    try:
        path = resolve(trace_arg)
    except FileNotFoundError as exc:
        raise _cli_error(str(exc), 2) from None
    try:
        return path, load(path)
    except TraceError as exc:
        more = len(exc.problems) - 1
        suffix = f" (and {more} more; run trace-validate)" if more else ""
        raise _cli_error(f"{exc}{suffix}", 1) from None


def _seconds(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_info(path: Path | str, trace) -> str:
    """The `trace-info` report."""
    s = trace.stats()
    causes = ", ".join(f"{cause} {count}" for cause, count in s.cuts_by_cause.items())
    period = (
        f"telemetry every {_seconds(trace.telemetry_period_s, 3)} s ({len(trace.telemetry)} samples)"
        if trace.telemetry_period_s is not None
        else "no telemetry"
    )
    lines = [
        f"trace        {trace.name}  ({path})",
        f"description  {trace.description}",
        f"duration     {_seconds(s.duration_s)} s ({s.duration_s / 3600:.2f} h), {period}, "
        f"reference request {_seconds(s.reference_request_s)} s, time scale {_seconds(trace.time_scale, 6)}",
    ]
    if s.windows:
        open_note = " (the last is open at the end of the trace)" if s.open_final_window else ""
        lines.append(
            f"windows      {s.windows}{open_note}: mean {_seconds(s.window_mean_s)} s, median "
            f"{_seconds(s.window_median_s)} s, min {_seconds(s.window_min_s)} s, max {_seconds(s.window_max_s)} s; "
            f"{s.windows_shorter_than_request} shorter than the reference request"
        )
    else:
        lines.append("windows      0 (the payload never has power)")
    lines.append(f"cuts         {s.cuts}: {causes}")
    if s.warned_cuts:
        lines.append(
            f"warning      {s.warned_cuts} of {s.cuts} cuts warned, mean lead {_seconds(s.warning_lead_mean_s)} s "
            f"(min {_seconds(s.warning_lead_min_s)} s, max {_seconds(s.warning_lead_max_s)} s)"
        )
    else:
        lines.append(f"warning      0 of {s.cuts} cuts warned (no lead time)")
    lines.append(f"off time     mean {_seconds(s.off_mean_s)} s between windows")
    lines.append(f"duty cycle   {100 * s.duty_cycle:.1f} % ({_seconds(s.on_time_s)} s on)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ commands


def format_catalog(rows: list[dict]) -> str:
    """The `trace-info` listing without a TRACE: one line per shipped trace."""
    lines = [f"{'TRACE':<14} {'DURATION':>10} {'WINDOWS':>7} {'CUTS':>5} {'DUTY':>6}  DESCRIPTION"]
    for r in rows:
        hours = f"{r['duration_s'] / 3600:.2f} h" if r["duration_s"] >= 3600 else f"{_seconds(r['duration_s'])} s"
        first = r["description"].split(". ")[0]
        lines.append(
            f"{r['trace']:<14} {hours:>10} {r['windows']:>7} {r['cuts']:>5} {100 * r['duty_cycle']:>5.1f}%  "
            f"{first[:60]}{'...' if len(first) > 60 else ''}"
        )
    lines.append("ow hil trace-info TRACE: one trace in full (windows, cuts by cause, warnings)")
    return "\n".join(lines)


def _catalog() -> list[dict]:
    rows = []
    for name in SHIPPED_NAMES:
        path, trace = _load(name)
        s = trace.stats()
        rows.append(
            {
                "trace": name,
                "path": str(path),
                "duration_s": s.duration_s,
                "windows": s.windows,
                "cuts": s.cuts,
                "duty_cycle": s.duty_cycle,
                "description": trace.description,
            }
        )
    return rows


def _cmd_info(args: argparse.Namespace) -> int:
    if args.trace is None:  # the shipped traces, to choose one from
        rows = _catalog()
        print(json.dumps(rows, indent=2) if args.json else format_catalog(rows))
        return 0
    path, trace = _load(args.trace)
    if args.json:
        out = {"trace": trace.name, "path": str(path), **trace.stats().as_dict()}
        print(json.dumps(out, indent=2))
    else:
        print(format_info(path, trace))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    status = 0
    for trace_arg in args.traces:
        path = resolve_quiet(trace_arg)
        problems = validate(path)
        if problems:
            status = 1
            for problem in problems:
                print(problem)
        elif not args.quiet:
            print(f"{path}: ok")
    return status


def _write(trace, out: str) -> str:
    if out == "-":
        sys.stdout.write(dumps(trace))
        return "<stdout>"
    try:
        dump(trace, out)
    except TraceError as exc:  # a generator or importer bug, not a user error
        raise RuntimeError(f"refusing to write an invalid trace: {exc}") from exc
    except OSError as exc:
        raise _cli_error(f"cannot write {out}: {exc.strerror or exc}", 2) from None
    return out


def _summary(trace) -> str:
    s = trace.stats()
    causes = ", ".join(f"{c} {n}" for c, n in s.cuts_by_cause.items() if n)
    return f"{s.windows} windows, {s.cuts} cuts ({causes or 'none'}), duty cycle {100 * s.duty_cycle:.1f} %"


#: The longest trace `trace-generate` makes: 31 days (the generator takes about 1.2 s of CPU and
#: 86,400 telemetry samples per simulated day, so a mistyped length would run for hours).
MAX_GENERATE_DURATION_S = 31 * 86400


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.duration is not None and not 0 < args.duration <= MAX_GENERATE_DURATION_S:
        raise _cli_error(f"--duration must be 1..{MAX_GENERATE_DURATION_S} seconds (31 days), not {args.duration}", 2)
    trace = generate(args.kind, seed=args.seed, duration_s=args.duration)
    where = _write(trace, args.out)
    print(f"{where}: {trace.name}, {_summary(trace)}", file=sys.stderr if args.out == "-" else sys.stdout)
    return 0


def _report_import(imported, out: str) -> int:
    """Warnings and notes to stderr, the trace to `out`, a summary line."""
    for warning in imported.warnings:
        print(warning, file=sys.stderr)
    for note in imported.notes:
        print(f"note: {note}", file=sys.stderr)
    trace = imported.trace
    where = _write(trace, out)
    warned = f"; {len(imported.warnings)} warning line(s) above" if imported.warnings else ""
    print(
        f"{where}: {trace.name}, {trace.duration_s:g} s, {_summary(trace)}{warned}",
        file=sys.stderr if out == "-" else sys.stdout,
    )
    return 0


def _no_reading(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        column, sep, value = item.rpartition("=")
        try:
            out[column] = float(value)
        except ValueError:
            column = ""
        if not sep or not column:
            raise _cli_error(f"--no-reading wants COLUMN=VALUE, not {item!r}", 2)
    return out


def _cmd_import_csv(args: argparse.Namespace) -> int:
    try:
        params = CsvImport(
            time=args.time,
            time_unit=args.time_unit,
            spread_repeats=args.spread_repeats,
            current=args.current,
            current_unit=args.current_unit,
            on_above_ma=args.on_above,
            temperature=args.temperature,
            thermal_at_c=args.thermal_at,
            voltage=args.voltage,
            voltage_unit=args.voltage_unit,
            battery=args.battery,
            battery_unit=args.battery_unit,
            battery_cells=args.battery_cells,
            payload_volts=args.payload_volts,
            no_reading=_no_reading(args.no_reading),
            other_cause=args.other_cause,
            from_s=args.from_s,
            to_s=args.to_s,
            max_gap_s=args.max_gap,
            name=args.name,
        )
        imported = import_csv(args.files, params)
    except CsvImportOptionsError as exc:
        raise _cli_error(str(exc), 2) from None
    except CsvImportError as exc:
        raise _cli_error(str(exc), 1) from None
    return _report_import(imported, args.out)


def _cmd_import_bupt1(args: argparse.Namespace) -> int:
    check_number(args.overheat_from_min, "--overheat-from-min", at_least=0)
    params = Bupt1Import(overheat_from_min=args.overheat_from_min)
    try:
        imported = import_bupt1_reported(args.data, params)
    except Bupt1DataError as exc:
        raise _cli_error(str(exc), 1) from None
    return _report_import(imported, args.out)


def _cmd_regenerate(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir) if args.out_dir else DATA_DIR
    builders: list[tuple[str, Callable[[], Any]]] = [(name, partial(generate, name)) for name in GENERATED_NAMES]
    builders.append(("bupt1", partial(import_bupt1, args.data)))
    status = 0
    for name, build in builders:
        target = out_dir / f"{name}{SUFFIX}"
        try:
            trace = build()
        except Bupt1DataError as exc:
            print(f"{target}: skipped, {exc}")
            continue
        if args.check:
            same = target.is_file() and target.read_text(encoding="utf-8") == dumps(trace)
            print(f"{target}: {'identical' if same else 'DIFFERS from a fresh regeneration'}")
            status |= 0 if same else 1
        else:
            print(f"{_write(trace, str(target))}: {_summary(trace)}")
    return status


# ------------------------------------------------------------------------------------ registration


_SHIPPED = ", ".join(SHIPPED_NAMES)


#: The trace commands, declared (common/cliargs.py); `register_trace_commands` adds them.
TRACE_COMMANDS: tuple[Command, ...] = (
    Command(
        "trace-info",
        handler=_cmd_info,
        help="list the shipped traces, or print one trace's statistics",
        description="Without TRACE: list the shipped traces (name, duration, windows, cuts, duty cycle, what "
        "each is). With TRACE: print its statistics: duration, windows, cuts by cause, window lengths, "
        "warning leads, duty cycle.",
        args=(
            arg(
                "trace",
                metavar="TRACE",
                nargs="?",
                default=None,
                help=f"a trace file, or a shipped trace name ({_SHIPPED}); omitted: list the shipped traces",
            ),
            arg("--json", action="store_true", help="print the statistics as JSON"),
        ),
    ),
    Command(
        "trace-validate",
        handler=_cmd_validate,
        help="check trace files against docs/trace-format.md",
        description="Check trace files. Prints each problem as FILE:LINE: message; exit status 1 if "
        "any trace is invalid.",
        args=(
            arg("traces", metavar="TRACE", nargs="+", help=f"trace files or shipped names ({_SHIPPED})"),
            arg("-q", "--quiet", action="store_true", help="print nothing for valid traces"),
        ),
    ),
    Command(
        "trace-generate",
        handler=_cmd_generate,
        help="generate a trace with the physical model",
        description="Generate a trace of one of the shipped kinds with the physical model "
        "(orbit, solar array and battery, thermal, FDIR, contention). With the shipped seed and "
        "default duration it reproduces the shipped file.",
        args=(
            arg("--kind", required=True, choices=list(PRESETS), help="satellite kind"),
            arg(
                "--seed",
                type=int,
                default=None,
                help="random seed (default: the shipped one: "
                + ", ".join(f"{k} {v}" for k, v in SHIPPED_SEEDS.items())
                + ")",
            ),
            arg(
                "--duration",
                type=int,
                default=None,
                metavar="SECONDS",
                help="trace length in seconds (default: the shipped length)",
            ),
            arg("--out", required=True, metavar="FILE", help="output file, or - for standard output"),
        ),
    ),
    Command(
        "trace-import-csv",
        handler=_cmd_import_csv,
        help="turn a telemetry CSV file into a trace",
        description="Turn telemetry CSV files (bus housekeeping, a published data set) into a trace, with the "
        "column mapping given here. The payload is on while its current is above --on-above; a cut is "
        "thermal when the temperature at the switch-off is at or above --thermal-at, --other-cause "
        "(power) otherwise. Telemetry is resampled to 1 Hz by the latest reading at or before each second; "
        "nothing is interpolated. Missing columns, time going backward, cells that are not numbers and "
        "readings outside the trace format's ranges stop the import with FILE:LINE: reason; time gaps, "
        "repeated time stamps and empty cells are warnings (FILE:LINE: warning: ...) and it goes on. "
        "Several files may be given when they share the time column (each mapped column in exactly one). "
        "See docs/trace-format.md section 10.",
        epilog="examples (the BUPT-1 files in ../shared/data/bupt1):\n"
        "  ow hil trace-import-csv overheating_telemetry_power.csv overheating_telemetry_temperature.csv \\\n"
        "      --time TIME --time-unit min --current I_Atlas200DK-B --on-above 100 \\\n"
        "      --temperature ATLAS_B_TEMP --thermal-at 30 --payload-volts 12 --from 25200 --out overheat.jsonl\n"
        "  ow hil trace-import-csv energy_shortterm_all.csv energy_shortterm_payload.csv \\\n"
        "      --time Time --time-unit datetime --spread-repeats --current I_Atlas200DK-B --on-above 100 \\\n"
        "      --voltage Total_U --voltage-unit mV --battery Battery_U --battery-unit mV \\\n"
        "      --no-reading Battery_U=0 --payload-volts 12 --out energy.jsonl",
        raw=True,
        args=(
            arg("files", metavar="FILE", nargs="+", help="CSV file(s) with a header line"),
            arg("--time", required=True, metavar="COLUMN", help="time column (in every file)"),
            arg(
                "--time-unit",
                choices=TIME_UNITS,
                default="s",
                help="s, min or ms from the log's own zero; unix: seconds since 1970; datetime: "
                "YYYY-MM-DD HH:MM[:SS] or YYYY/M/D H:MM, UTC unless it has an offset (default s)",
            ),
            arg(
                "--spread-repeats",
                action="store_true",
                help="rows sharing a time stamp are evenly spaced samples within the stamp's resolution "
                "(60 rows under an HH:MM stamp: one per second); without it a repeated stamp is a warning",
            ),
            arg("--current", required=True, metavar="COLUMN", help="the payload's supply current"),
            arg("--current-unit", choices=CURRENT_UNITS, default="mA", help="(default mA)"),
            arg(
                "--on-above",
                required=True,
                type=float,
                metavar="MILLIAMPS",
                help="the payload is on while its current is above this",
            ),
            arg("--temperature", default=None, metavar="COLUMN", help="payload temperature (C)"),
            arg(
                "--thermal-at",
                type=float,
                default=None,
                metavar="CELSIUS",
                help="a cut with the temperature at or above this is thermal",
            ),
            arg(
                "--other-cause",
                choices=["power", "fdir", "contention"],
                default="power",
                help="cause of the other cuts, which the log does not explain (default power)",
            ),
            arg("--voltage", default=None, metavar="COLUMN", help="bus voltage"),
            arg("--voltage-unit", choices=VOLTAGE_UNITS, default="V", help="(default V)"),
            arg(
                "--battery",
                default=None,
                metavar="COLUMN",
                help="battery state of charge, or a battery voltage turned into one (--battery-unit)",
            ),
            arg(
                "--battery-unit",
                choices=BATTERY_UNITS,
                default="soc",
                help="soc: 0..1; percent; V or mV: through BUPT-1's Li-ion pack curve (default soc)",
            ),
            arg(
                "--battery-cells",
                type=int,
                default=4,
                metavar="N",
                help="cells in series of a pack given in volts (the curve's pack has 4; default 4)",
            ),
            arg(
                "--payload-volts",
                type=float,
                default=None,
                metavar="VOLTS",
                help="payload power = current x this supply voltage (default: payload power not in telemetry)",
            ),
            arg(
                "--no-reading",
                action="append",
                default=[],
                metavar="COLUMN=VALUE",
                help="this value in this column means no reading in the row (multiplexed channels; repeatable)",
            ),
            arg(
                "--from",
                dest="from_s",
                type=float,
                default=None,
                metavar="SECONDS",
                help="start of the excerpt on the log's time axis (for unix and datetime: seconds after the "
                "first time stamp); default the first current reading",
            ),
            arg(
                "--to",
                dest="to_s",
                type=float,
                default=None,
                metavar="SECONDS",
                help="end of the excerpt on the same axis (default: where the first mapped file ends)",
            ),
            arg(
                "--max-gap",
                type=float,
                default=None,
                metavar="SECONDS",
                help="a longer time step is reported as a gap (default twice the file's median step)",
            ),
            arg("--name", default=None, help="trace name (default from the first file's name)"),
            arg("--out", required=True, metavar="TRACE", help="output file, or - for standard output"),
        ),
    ),
    Command(
        "trace-import-bupt1",
        handler=_cmd_import_bupt1,
        help="turn BUPT-1 in-orbit telemetry into a trace",
        description="Import the BUPT-1 CubeSat telemetry CSV files (see traces/importers/bupt1.py): a preset "
        "of trace-import-csv for the four files, two segments joined.",
        args=(
            arg(
                "--data",
                default=None,
                metavar="DIR",
                help="folder with the four BUPT-1 CSV files (default: $OW_BUPT1_DATA or "
                "../shared/data/bupt1 next to the repository)",
            ),
            arg("--out", required=True, metavar="FILE", help="output file, or - for standard output"),
            arg(
                "--overheat-from-min",
                type=float,
                default=420.0,
                metavar="MIN",
                help="start of the overheating-test excerpt in test minutes (default 420)",
            ),
        ),
    ),
    Command(
        "trace-regenerate",
        handler=_cmd_regenerate,
        help="rebuild the shipped traces (or check them)",
        description="Rebuild every shipped trace from its generator seed or from the BUPT-1 data. "
        "With --check, compare instead of writing; exit status 1 if any differs.",
        args=(
            arg("--check", action="store_true", help="compare with the files instead of writing"),
            arg("--out-dir", default=None, metavar="DIR", help="where to write (default traces/data)"),
            arg("--data", default=None, metavar="DIR", help="BUPT-1 data folder (as trace-import-bupt1)"),
        ),
    ),
)


def register_trace_commands(subparsers: Any) -> None:
    """Add the trace leaf commands to an argparse `add_subparsers()` object."""
    add_commands(subparsers, TRACE_COMMANDS)


def main(argv: list[str] | None = None) -> int:
    """`python -m traces`: the trace commands without the rest of `ow`."""

    parser = argparse.ArgumentParser(
        prog="python -m traces",
        description="Interruption traces: inspect, validate, generate and import.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    register_trace_commands(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        print(f"{parser.prog} {args.command}: interrupted", file=sys.stderr)
        return 130
