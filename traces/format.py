"""Reader, writer and validator for the trace file format (docs/trace-format.md).

Every check reports a `Problem(file, line, message)`; `load` raises `TraceError`, whose str is
`file:line: message` for the first problem. The validator keeps going after a problem where it
can, so one run lists everything wrong with a file.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traces.catalog import resolve_quiet
from traces.model import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CutCause,
    Event,
    EventKind,
    TelemetrySample,
    Trace,
    thaw,
    times_equal,
)

MAX_LINE_BYTES = 65_536
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
SOURCE_KINDS = ("generator", "import", "manual")
HEADER_KEYS = (
    "format",
    "version",
    "name",
    "description",
    "duration_s",
    "telemetry_period_s",
    "reference_request_s",
    "time_scale",
    "source",
    "assumptions",
)
EVENT_KEYS = {
    EventKind.POWER_ON.value: ("type", "t"),
    EventKind.WARNING.value: ("type", "t", "cause", "lead_s"),
    EventKind.CUT.value: ("type", "t", "cause", "lead_s"),
}
# (name, lowest, highest) for telemetry columns 1..4; see docs/trace-format.md section 3.2.
TELEMETRY_RANGES = (
    ("bus_voltage_v", 0.0, 100.0),
    ("battery_soc", 0.0, 1.0),
    ("payload_temp_c", -150.0, 150.0),
    ("payload_power_w", 0.0, 10_000.0),
)
CAUSE_NAMES = ", ".join(c.value for c in CutCause)


@dataclass(frozen=True)
class Problem:
    """One violation of the format, located at `file:line` (line 0 = the file as a whole)."""

    file: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


class TraceError(ValueError):
    """A trace that cannot be read. str() is `file:line: message` of the first problem;
    `problems` lists all of them."""

    def __init__(self, problems: Sequence[Problem]):
        if not problems:
            raise ValueError("TraceError needs at least one problem")
        self.problems: list[Problem] = list(problems)
        first = self.problems[0]
        self.file, self.line, self.message = first.file, first.line, first.message
        super().__init__(str(first))

    def __str__(self) -> str:
        return str(self.problems[0])


# ---------------------------------------------------------------------------------- numbers


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def format_number(value: float | int) -> str:
    """Canonical JSON number: integral values without a fraction, others in shortest repr."""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    if number.is_integer() and abs(number) < 2**53:
        return str(int(number))
    return repr(number)


def _fmt_t(value: float) -> str:
    """Times in messages: as in the file, without spurious digits."""
    return format_number(value) if math.isfinite(value) else str(value)


def _canonical_json(value: Any) -> Any:
    """JSON-ready copy with integral floats turned into ints (deterministic text)."""
    value = thaw(value)
    if isinstance(value, Mapping):
        return {str(k): _canonical_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical_json(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


_INVALID = object()  # marks a line whose JSON did not parse (JSON null is a real value)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


# ---------------------------------------------------------------------------------- writing


def trace_to_lines(trace: Trace) -> list[str]:
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "name": trace.name,
        "description": trace.description,
        "duration_s": trace.duration_s,
        "telemetry_period_s": trace.telemetry_period_s,
        "reference_request_s": trace.reference_request_s,
        "time_scale": trace.time_scale,
        "source": trace.source,
        "assumptions": list(trace.assumptions),
    }
    lines = [json.dumps(_canonical_json(header), separators=(",", ":"), ensure_ascii=False, allow_nan=False)]
    event_lines: list[tuple[float, str]] = []
    for event in trace.events:
        if event.kind is EventKind.POWER_ON:
            text = f'{{"type":"power_on","t":{format_number(event.t_s)}}}'
        else:
            cause = event.cause.value if event.cause is not None else None
            text = (
                f'{{"type":"{event.kind.value}","t":{format_number(event.t_s)},'
                f'"cause":{json.dumps(cause)},"lead_s":{format_number(event.lead_s)}}}'
            )
        event_lines.append((event.t_s, text))
    sample_lines: list[tuple[float, str]] = []
    for sample in trace.telemetry:
        values = [sample.bus_voltage_v, sample.battery_soc, sample.payload_temp_c, sample.payload_power_w]
        text = (
            "["
            + ",".join([format_number(sample.t_s)] + ["null" if v is None else format_number(v) for v in values])
            + "]"
        )
        sample_lines.append((sample.t_s, text))
    # Merge the two streams by time, events first at equal times (invariant T1). Each stream keeps
    # its own order, so an out-of-order trace stays out of order and the validator catches it.
    i = j = 0
    while i < len(event_lines) or j < len(sample_lines):
        if j == len(sample_lines) or (
            i < len(event_lines)
            and (event_lines[i][0] <= sample_lines[j][0] or times_equal(event_lines[i][0], sample_lines[j][0]))
        ):
            lines.append(event_lines[i][1])
            i += 1
        else:
            lines.append(sample_lines[j][1])
            j += 1
    return lines


def dumps(trace: Trace) -> str:
    return "".join(line + "\n" for line in trace_to_lines(trace))


def dump(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write `trace` to `path` atomically (temp file, fsync, rename). Refuses an invalid trace."""
    path = Path(path)
    lines = trace_to_lines(trace)
    problems = validate_lines(lines, file=str(path))
    if problems:
        raise TraceError(problems)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; a trace is a shareable data file
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            handle.write("".join(line + "\n" for line in lines))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


# ---------------------------------------------------------------------------------- reading


def _split_file_bytes(data: bytes, file: str) -> tuple[list[str], list[Problem]]:
    """Byte-level checks (section 1) and the split into lines."""
    problems: list[Problem] = []
    if not data:
        return [], [Problem(file, 0, "empty file: a trace needs at least its header line")]
    if data.startswith(b"\xef\xbb\xbf"):
        problems.append(Problem(file, 1, "file starts with a UTF-8 byte-order mark; write plain UTF-8"))
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        problems.append(Problem(file, line, f"not valid UTF-8 (byte {data[exc.start]:#04x})"))
        text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    else:
        problems.append(Problem(file, len(lines), "last line does not end with a newline (truncated write?)"))
    return lines, problems


def _line_problems(lines: Sequence[str], file: str) -> list[Problem]:
    problems: list[Problem] = []
    for number, line in enumerate(lines, start=1):
        if "\r" in line:
            problems.append(Problem(file, number, "carriage return in line: use LF line endings"))
        if not line.strip():
            problems.append(Problem(file, number, "blank line"))
        size = len(line.encode("utf-8"))
        if size > MAX_LINE_BYTES:
            problems.append(Problem(file, number, f"line is {size} bytes long; the limit is {MAX_LINE_BYTES}"))
    return problems


class _Parser:
    """Parses header and body lines into records and checks every invariant of section 4."""

    def __init__(self, file: str):
        self.file = file
        self.problems: list[Problem] = []
        self.header: dict[str, Any] = {}
        self.header_ok = False
        # Records that parsed, with their line numbers.
        self.events: list[tuple[int, Event]] = []
        self.samples: list[tuple[int, TelemetrySample]] = []
        # Every telemetry line whose time parsed, valid or not: the grid check uses these so that
        # one bad value is not also reported as a gap.
        self.sample_times: list[tuple[int, float]] = []
        # Lines of events whose type and time parsed but whose cause or lead did not: they still
        # drive the on/off state (so one bad field does not cascade) but are not paired.
        self.damaged_events: set[int] = set()
        self.body_order: list[tuple[int, float, bool]] = []  # (line, t, is_event)

    def problem(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.file, line, message))

    # ---------------------------------------------------------------- JSON per line

    def _json(self, number: int, text: str) -> Any:
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as exc:
            self.problem(number, f"invalid JSON: {exc.msg} at column {exc.colno}")
        except ValueError as exc:
            self.problem(number, f"invalid JSON: {exc}")
        return _INVALID

    # ---------------------------------------------------------------- header

    def parse_header(self, text: str) -> None:
        value = self._json(1, text)
        if value is _INVALID:
            return
        if not isinstance(value, dict):
            self.problem(1, 'line 1 must be the header object (a JSON object with "format")')
            return
        if value.get("format") != FORMAT_NAME:
            self.problem(
                1,
                f'not an interruption trace: header "format" must be "{FORMAT_NAME}", '
                f"found {json.dumps(value.get('format'))}",
            )
            return
        ok = True
        version = value.get("version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            self.problem(
                1, f"unsupported format version {json.dumps(version)}; this reader knows version {FORMAT_VERSION}"
            )
            return
        for key in value:
            if key not in HEADER_KEYS:
                self.problem(1, f'unknown header key "{key}" (known: {", ".join(HEADER_KEYS)})')
                ok = False
        for key in HEADER_KEYS:
            if key not in value:
                self.problem(1, f'header is missing "{key}"')
                ok = False
        name = value.get("name")
        if "name" in value and not (isinstance(name, str) and NAME_PATTERN.match(name)):
            self.problem(
                1,
                f'header "name" {json.dumps(name)} must be 1-64 characters of a-z 0-9 . _ -, '
                "starting with a letter or digit",
            )
            ok = False
        if "description" in value and not isinstance(value["description"], str):
            self.problem(1, 'header "description" must be a string')
            ok = False
        for key in ("duration_s", "reference_request_s", "time_scale"):
            if key in value and not (_is_number(value[key]) and value[key] > 0):
                self.problem(1, f'header "{key}" must be a number > 0, found {json.dumps(value[key])}')
                ok = False
        period = value.get("telemetry_period_s")
        if "telemetry_period_s" in value and period is not None and not (_is_number(period) and period > 0):
            self.problem(1, f'header "telemetry_period_s" must be a number > 0 or null, found {json.dumps(period)}')
            ok = False
        source = value.get("source")
        if "source" in value:
            if not isinstance(source, dict):
                self.problem(1, 'header "source" must be an object')
                ok = False
            elif source.get("kind") not in SOURCE_KINDS:
                self.problem(
                    1,
                    f'header "source" needs "kind" one of {", ".join(SOURCE_KINDS)}, '
                    f"found {json.dumps(source.get('kind'))}",
                )
                ok = False
        assumptions = value.get("assumptions")
        if "assumptions" in value and not (
            isinstance(assumptions, list) and all(isinstance(a, str) for a in assumptions)
        ):
            self.problem(1, 'header "assumptions" must be an array of strings')
            ok = False
        self.header = value
        self.header_ok = ok

    # ---------------------------------------------------------------- body records

    def parse_body_line(self, number: int, text: str) -> None:
        value = self._json(number, text)
        if value is _INVALID:
            return
        if isinstance(value, dict):
            self._parse_event(number, value)
        elif isinstance(value, list):
            self._parse_sample(number, value)
        else:
            self.problem(number, "expected an event object or a telemetry array")

    def _parse_event(self, number: int, value: dict[str, Any]) -> None:
        kind = value.get("type")
        if kind == "header" or "format" in value:
            self.problem(number, "a second header: the header is line 1 only")
            return
        if kind not in EVENT_KEYS:
            self.problem(number, f"unknown event type {json.dumps(kind)} (known: power_on, warning, cut)")
            return
        allowed = EVENT_KEYS[kind]
        for key in value:
            if key not in allowed:
                self.problem(number, f'{kind} event has unknown key "{key}" (allowed: {", ".join(allowed)})')
                return
        for key in allowed:
            if key not in value:
                self.problem(number, f'{kind} event is missing "{key}"')
                return
        t = value["t"]
        if not _is_number(t):
            self.problem(number, f'{kind} event "t" must be a number, found {json.dumps(t)}')
            return
        cause: CutCause | None = None
        lead = 0.0
        if kind != EventKind.POWER_ON.value:
            damaged = True
            lead = value["lead_s"]
            try:
                cause = CutCause(value["cause"])
            except (ValueError, TypeError):
                self.problem(
                    number,
                    f"{kind} at t={_fmt_t(t)} has cause {json.dumps(value['cause'])}; "
                    f"the cause must be one of {CAUSE_NAMES}",
                )
            else:
                if not _is_number(lead) or lead < 0:
                    self.problem(
                        number, f"{kind} at t={_fmt_t(t)} has lead_s {json.dumps(lead)}; it must be a number >= 0"
                    )
                elif kind == EventKind.WARNING.value and lead == 0:
                    self.problem(
                        number,
                        f"warning at t={_fmt_t(t)} has lead_s 0; a warning needs lead_s > 0 "
                        "(an unannounced cut simply has no warning)",
                    )
                else:
                    damaged = False
            if damaged:
                self.damaged_events.add(number)
                lead = 0.0
        event = Event(float(t), EventKind(kind), cause, float(lead))
        self.events.append((number, event))
        self.body_order.append((number, event.t_s, True))

    def _parse_sample(self, number: int, value: list[Any]) -> None:
        if len(value) != 5:
            self.problem(
                number,
                f"telemetry sample has {len(value)} values; expected 5 "
                "[t, bus_voltage_v, battery_soc, payload_temp_c, payload_power_w]",
            )
            return
        t = value[0]
        if not _is_number(t):
            self.problem(number, f'telemetry "t" must be a number, found {json.dumps(t)}')
            return
        self.sample_times.append((number, float(t)))
        fields: list[float | None] = []
        for (name, low, high), item in zip(TELEMETRY_RANGES, value[1:], strict=True):
            if item is None:
                fields.append(None)
                continue
            if not _is_number(item):
                self.problem(
                    number, f"telemetry {name} at t={_fmt_t(t)} must be a number or null, found {json.dumps(item)}"
                )
                return
            if not low <= item <= high:
                self.problem(
                    number,
                    f"telemetry {name}={format_number(item)} at t={_fmt_t(t)} is outside "
                    f"[{format_number(low)}, {format_number(high)}]",
                )
                return
            fields.append(float(item))
        sample = TelemetrySample(float(t), *fields)
        self.samples.append((number, sample))
        self.body_order.append((number, sample.t_s, False))

    # ---------------------------------------------------------------- invariants

    def check_invariants(self, last_line: int) -> None:
        duration = self.header.get("duration_s") if self.header_ok else None
        self._check_order_and_range(duration)
        self._check_power_state(duration)
        self._check_telemetry(duration, last_line)

    def _check_order_and_range(self, duration: float | None) -> None:
        previous: tuple[int, float, bool] | None = None
        for number, t, is_event in self.body_order:
            if t < 0 or (duration is not None and t > duration and not times_equal(t, duration)):
                where = "event" if is_event else "telemetry sample"
                self.problem(number, f"{where} at t={_fmt_t(t)} is outside the trace [0, {_fmt_t(duration or 0)}]")
            if previous is not None:
                p_number, p_t, p_is_event = previous
                if t < p_t and not times_equal(t, p_t):
                    self.problem(number, f"time goes backwards: t={_fmt_t(t)} after t={_fmt_t(p_t)} (line {p_number})")
                elif times_equal(t, p_t) and is_event and not p_is_event:
                    self.problem(
                        number,
                        f"event at t={_fmt_t(t)} comes after the telemetry sample at the same "
                        f"time (line {p_number}); events at a time come before its sample",
                    )
            previous = (number, t, is_event)

    def _check_power_state(self, duration: float | None) -> None:
        on = False
        window_start: tuple[int, float] | None = None
        last_cut: tuple[int, float] | None = None
        warning: tuple[int, Event] | None = None
        for number, event in self.events:
            t = event.t_s
            if event.kind is EventKind.POWER_ON:
                if on:
                    assert window_start is not None
                    self.problem(
                        number,
                        f"power_on at t={_fmt_t(t)} while the payload is already on "
                        f"(since t={_fmt_t(window_start[1])}, line {window_start[0]}); "
                        "power_on and cut must alternate",
                    )
                    continue
                if last_cut is not None and (t < last_cut[1] or times_equal(t, last_cut[1])):
                    self.problem(
                        number,
                        f"power_on at t={_fmt_t(t)} with no off time after the cut at "
                        f"t={_fmt_t(last_cut[1])} (line {last_cut[0]}); an off period must be longer than 0",
                    )
                on, window_start, warning = True, (number, t), None
            elif event.kind is EventKind.WARNING:
                if not on:
                    self.problem(number, f"warning at t={_fmt_t(t)} while the payload is off")
                    continue
                if number in self.damaged_events:
                    continue
                if event.cause is CutCause.FDIR:
                    self.problem(number, f"warning with cause 'fdir' at t={_fmt_t(t)}; FDIR resets are never announced")
                if warning is not None:
                    self.problem(
                        number,
                        f"second warning in one window (first at t={_fmt_t(warning[1].t_s)}, "
                        f"line {warning[0]}); a window holds at most one warning",
                    )
                    continue
                announced = t + event.lead_s
                if duration is not None and announced > duration and not times_equal(announced, duration):
                    self.problem(
                        number,
                        f"warning at t={_fmt_t(t)} announces a cut at t={_fmt_t(announced)}, "
                        f"after the end of the trace (duration_s={_fmt_t(duration)})",
                    )
                warning = (number, event)
            else:  # cut
                if not on:
                    self.problem(
                        number,
                        f"cut at t={_fmt_t(t)} while the payload is already off; power_on and cut must alternate",
                    )
                    continue
                assert window_start is not None
                if t < window_start[1] or times_equal(t, window_start[1]):
                    self.problem(
                        number,
                        f"cut at t={_fmt_t(t)} ends a window that started at the same time "
                        f"(line {window_start[0]}); a window must be longer than 0",
                    )
                if event.cause is CutCause.FDIR and event.lead_s > 0:
                    self.problem(
                        number,
                        f"cut with cause 'fdir' has lead_s={_fmt_t(event.lead_s)}; FDIR resets are "
                        "never announced (lead_s must be 0)",
                    )
                if number not in self.damaged_events:
                    self._check_cut_against_warning(number, event, warning)
                on, last_cut, warning = False, (number, t), None
        if on and warning is not None:
            w_number, w_event = warning
            self.problem(
                w_number,
                f"warning at t={_fmt_t(w_event.t_s)} announces a cut at "
                f"t={_fmt_t(w_event.t_s + w_event.lead_s)}, but the trace ends before any cut",
            )

    def _check_cut_against_warning(self, number: int, cut: Event, warning: tuple[int, Event] | None) -> None:
        if warning is None:
            if cut.lead_s > 0:
                self.problem(
                    number,
                    f"cut at t={_fmt_t(cut.t_s)} has lead_s={_fmt_t(cut.lead_s)} but no warning "
                    "in its window (lead_s must be 0 for an unannounced cut)",
                )
            return
        w_number, w_event = warning
        announced = w_event.t_s + w_event.lead_s
        if not times_equal(announced, cut.t_s):
            self.problem(
                w_number,
                f"warning at t={_fmt_t(w_event.t_s)} announces a cut at t={_fmt_t(announced)}, "
                f"but the window's cut is at t={_fmt_t(cut.t_s)} (line {number})",
            )
            return
        if cut.cause is not w_event.cause:
            self.problem(
                number,
                f"cut at t={_fmt_t(cut.t_s)} has cause '{cut.cause}' but its warning "
                f"(line {w_number}) announced '{w_event.cause}'",
            )
        if not times_equal(cut.lead_s, w_event.lead_s):
            self.problem(
                number,
                f"cut at t={_fmt_t(cut.t_s)} has lead_s={_fmt_t(cut.lead_s)} but its warning "
                f"(line {w_number}) came {_fmt_t(w_event.lead_s)} s before",
            )

    def _check_telemetry(self, duration: float | None, last_line: int) -> None:
        if not self.header_ok:
            return
        period = self.header.get("telemetry_period_s")
        if period is None:
            if self.sample_times:
                self.problem(self.sample_times[0][0], "telemetry sample in a trace whose telemetry_period_s is null")
            return
        assert duration is not None
        expected = int(math.floor(duration / period + 1e-9)) + 1
        times = self.sample_times
        for index, (number, t) in enumerate(times):
            want = index * period
            if not times_equal(t, want):
                self.problem(
                    number,
                    f"telemetry sample {index} expected at t={_fmt_t(want)}, found "
                    f"t={_fmt_t(t)} (gap or duplicate; samples every "
                    f"{_fmt_t(period)} s from 0)",
                )
                return  # later samples would all be misplaced too; one report is enough
        if len(times) < expected:
            where = times[-1][0] if times else 1
            found = f"the last is at t={_fmt_t(times[-1][1])}" if times else "there are none"
            self.problem(
                where,
                f"telemetry stops early: expected {expected} samples (t=0..{_fmt_t((expected - 1) * period)} "
                f"every {_fmt_t(period)} s), {found}",
            )
        elif len(times) > expected:
            self.problem(
                times[expected][0], f"telemetry has {len(times)} samples; a {_fmt_t(duration)} s trace has {expected}"
            )

    # ---------------------------------------------------------------- result

    def trace(self) -> Trace:
        h = self.header
        return Trace(
            name=h["name"],
            description=h["description"],
            duration_s=float(h["duration_s"]),
            events=tuple(event for _, event in self.events),
            telemetry=tuple(sample for _, sample in self.samples),
            telemetry_period_s=None if h["telemetry_period_s"] is None else float(h["telemetry_period_s"]),
            reference_request_s=float(h["reference_request_s"]),
            time_scale=float(h["time_scale"]),
            source=h["source"],
            assumptions=tuple(h["assumptions"]),
        )


def _parse(lines: Sequence[str], file: str, pre_problems: Iterable[Problem] = ()) -> tuple[Trace | None, list[Problem]]:
    parser = _Parser(file)
    parser.problems.extend(pre_problems)
    if not lines:
        if not parser.problems:
            parser.problem(0, "empty file: a trace needs at least its header line")
        return None, parser.problems
    parser.parse_header(lines[0])
    for number, text in enumerate(lines[1:], start=2):
        if text.strip():
            parser.parse_body_line(number, text)
    parser.check_invariants(last_line=len(lines))
    parser.problems.sort(key=lambda p: p.line)
    if parser.problems:
        return None, parser.problems
    return parser.trace(), []


def _strip_newlines(lines: Iterable[str]) -> list[str]:
    return [line[:-1] if line.endswith("\n") else line for line in lines]


def validate_lines(lines: Iterable[str], file: str = "<memory>") -> list[Problem]:
    """Problems in a trace given as lines (trailing newlines optional); empty when valid."""
    stripped = _strip_newlines(lines)
    return _parse(stripped, file, _line_problems(stripped, file))[1]


def trace_problems(trace: Trace) -> list[Problem]:
    """Every invariant `trace` violates (empty when valid): its text form run through the validator."""
    return validate_lines(trace_to_lines(trace), file=f"<trace {trace.name}>")


def parse_lines(lines: Iterable[str], file: str = "<memory>") -> Trace:
    stripped = _strip_newlines(lines)
    trace, problems = _parse(stripped, file, _line_problems(stripped, file))
    if problems:
        raise TraceError(problems)
    assert trace is not None
    return trace


def loads(text: str, file: str = "<string>") -> Trace:
    """Parse a whole trace file's text (file-level rules such as the final newline apply)."""
    lines, problems = _split_file_bytes(text.encode("utf-8"), file)
    trace, more = _parse(lines, file, problems + _line_problems(lines, file))
    if more:
        raise TraceError(more)
    assert trace is not None
    return trace


def _read(path: str | os.PathLike[str]) -> tuple[Trace | None, list[Problem]]:
    file = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return None, [Problem(file, 0, f"cannot read: {exc.strerror or exc}")]
    lines, problems = _split_file_bytes(data, file)
    return _parse(lines, file, problems + _line_problems(lines, file))


def validate(path: str | os.PathLike[str]) -> list[Problem]:
    """Every problem in the trace file at `path` (or a shipped trace name); empty when valid."""
    return _read(resolve_quiet(path))[1]


def load(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file. `path` may also be a shipped trace name ("trace-a").
    Raises `TraceError` (str: `file:line: message`)."""
    trace, problems = _read(resolve_quiet(path))
    if problems:
        raise TraceError(problems)
    assert trace is not None
    return trace
