"""Trace file format: the validator rejects each kind of malformation at the right file and line,
valid files round-trip exactly, and the documentation's example is valid."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_testkit import write_lines

import traces
from traces import CutCause, PowerWindow, TelemetrySample, Trace, TraceError
from traces.format import dumps, load, loads, parse_lines, trace_to_lines, validate, validate_lines

Mutation = Callable[[list[str]], list[str]]


def replace_line(number: int, text: str) -> Mutation:
    def mutate(lines: list[str]) -> list[str]:
        out = list(lines)
        out[number - 1] = text
        return out

    return mutate


def insert_before(number: int, text: str) -> Mutation:
    def mutate(lines: list[str]) -> list[str]:
        out = list(lines)
        out.insert(number - 1, text)
        return out

    return mutate


def delete_line(number: int) -> Mutation:
    def mutate(lines: list[str]) -> list[str]:
        out = list(lines)
        del out[number - 1]
        return out

    return mutate


def edit_header(**changes) -> Mutation:
    def mutate(lines: list[str]) -> list[str]:
        header = json.loads(lines[0])
        for key, value in changes.items():
            if value is ...:
                header.pop(key)
            else:
                header[key] = value
        return [json.dumps(header, separators=(",", ":"))] + lines[1:]

    return mutate


# Line numbers refer to the example trace of conftest.py (docs/trace-format.md, section 5):
#  1 header | 2 power_on t=0 | 3-5 telemetry 0-2 | 6 warning t=3 | 7-8 telemetry 3-4 | 9 cut t=5
# 10-12 telemetry 5-7 | 13 power_on t=8 | 14-16 telemetry 8-10 | 17 cut t=11 | 18-19 telemetry 11-12
BROKEN = [
    # (id, mutation, expected line, message fragment)
    ("invalid-json", replace_line(7, "[3,16.2,0.95,51,15"), 7, "invalid JSON"),
    ("nan-number", replace_line(7, "[3,16.2,NaN,51,15]"), 7, "invalid JSON"),
    ("header-not-a-trace", edit_header(format="something-else"), 1, "not an interruption trace"),
    ("header-version", edit_header(version=2), 1, "unsupported format version 2"),
    ("header-unknown-key", edit_header(durations=12), 1, 'unknown header key "durations"'),
    ("header-missing-key", edit_header(duration_s=...), 1, 'header is missing "duration_s"'),
    ("header-bad-name", edit_header(name="Sat 1"), 1, 'header "name"'),
    ("header-zero-duration", edit_header(duration_s=0), 1, '"duration_s" must be a number > 0'),
    ("header-bad-period", edit_header(telemetry_period_s=-1), 1, '"telemetry_period_s" must be'),
    ("header-bad-source", edit_header(source={"kind": "guess"}), 1, '"source" needs "kind"'),
    ("header-bad-assumptions", edit_header(assumptions="none"), 1, '"assumptions" must be an array'),
    ("header-in-body", insert_before(3, '{"format":"orbitweaver-trace","version":1}'), 3, "a second header"),
    ("not-object-or-array", replace_line(7, '"telemetry"'), 7, "expected an event object or a telemetry array"),
    ("unknown-event-type", replace_line(13, '{"type":"reboot","t":8}'), 13, 'unknown event type "reboot"'),
    ("event-unknown-key", replace_line(17, '{"type":"cut","t":11,"cause":"fdir","lead":0}'), 17, 'unknown key "lead"'),
    ("cut-missing-cause", replace_line(17, '{"type":"cut","t":11,"lead_s":0}'), 17, 'missing "cause"'),
    (
        "cut-unknown-cause",
        replace_line(17, '{"type":"cut","t":11,"cause":"solar","lead_s":0}'),
        17,
        "the cause must be one of power, thermal, fdir, contention",
    ),
    (
        "cut-null-cause",
        replace_line(17, '{"type":"cut","t":11,"cause":null,"lead_s":0}'),
        17,
        "the cause must be one of",
    ),
    ("t-not-number", replace_line(13, '{"type":"power_on","t":"8"}'), 13, '"t" must be a number'),
    ("t-boolean", replace_line(13, '{"type":"power_on","t":true}'), 13, '"t" must be a number'),
    (
        "negative-lead",
        replace_line(17, '{"type":"cut","t":11,"cause":"power","lead_s":-1}'),
        17,
        "must be a number >= 0",
    ),
    ("event-after-end", replace_line(17, '{"type":"cut","t":13,"cause":"fdir","lead_s":0}'), 17, "outside the trace"),
    ("time-backwards", replace_line(13, '{"type":"power_on","t":6.5}'), 13, "time goes backwards"),
    (
        "event-after-same-time-sample",
        lambda ls: ls[:12] + [ls[13], ls[12]] + ls[14:],
        14,
        "comes after the telemetry sample at the same time",
    ),
    ("double-power-on", replace_line(9, '{"type":"power_on","t":5}'), 9, "already on"),
    ("cut-while-off", insert_before(12, '{"type":"cut","t":7,"cause":"power","lead_s":0}'), 12, "already off"),
    (
        "zero-length-window",
        lambda ls: ls[:13] + ['{"type":"cut","t":8,"cause":"fdir","lead_s":0}'] + ls[13:16] + ls[17:],
        14,
        "a window must be longer than 0",
    ),
    (
        "zero-off-time",
        lambda ls: ls[:9] + ['{"type":"power_on","t":5}'] + ls[9:12] + ls[13:],
        10,
        "an off period must be longer than 0",
    ),
    (
        "warning-while-off",
        insert_before(12, '{"type":"warning","t":7,"cause":"power","lead_s":4}'),
        12,
        "while the payload is off",
    ),
    (
        "warning-zero-lead",
        replace_line(6, '{"type":"warning","t":3,"cause":"thermal","lead_s":0}'),
        6,
        "a warning needs lead_s > 0",
    ),
    (
        "second-warning",
        insert_before(7, '{"type":"warning","t":3,"cause":"thermal","lead_s":2}'),
        7,
        "second warning in one window",
    ),
    (
        "warning-wrong-time",
        replace_line(6, '{"type":"warning","t":3,"cause":"thermal","lead_s":3}'),
        6,
        "announces a cut at t=6, but the window's cut is at t=5 (line 9)",
    ),
    (
        "warning-cause-mismatch",
        replace_line(9, '{"type":"cut","t":5,"cause":"power","lead_s":2}'),
        9,
        "but its warning (line 6) announced 'thermal'",
    ),
    ("cut-lead-without-warning", delete_line(6), 8, "has lead_s=2 but no warning in its window"),
    (
        "cut-lead-zero-after-warning",
        replace_line(9, '{"type":"cut","t":5,"cause":"thermal","lead_s":0}'),
        9,
        "its warning (line 6) came 2 s before",
    ),
    (
        "fdir-with-lead",
        lambda ls: (
            ls[:15]
            + [
                '{"type":"warning","t":10,"cause":"fdir","lead_s":1}',
                ls[15],
                '{"type":"cut","t":11,"cause":"fdir","lead_s":1}',
            ]
            + ls[17:]
        ),
        18,
        "FDIR resets are never announced (lead_s must be 0)",
    ),
    (
        "fdir-warning",
        lambda ls: (
            ls[:15]
            + [
                '{"type":"warning","t":10,"cause":"fdir","lead_s":1}',
                ls[15],
                '{"type":"cut","t":11,"cause":"fdir","lead_s":1}',
            ]
            + ls[17:]
        ),
        16,
        "warning with cause 'fdir'",
    ),
    (
        "warning-past-end",
        lambda ls: ls[:16] + ['{"type":"warning","t":11,"cause":"power","lead_s":5}'] + ls[17:],
        17,
        "after the end of the trace",
    ),
    (
        "warning-never-cut",
        lambda ls: ls[:16] + ['{"type":"warning","t":11,"cause":"power","lead_s":1}'] + ls[17:],
        17,
        "the trace ends before any cut",
    ),
    ("telemetry-gap", delete_line(11), 11, "telemetry sample 6 expected at t=6, found t=7"),
    (
        "telemetry-duplicate",
        insert_before(11, "[5,16.21,0.95,55,0]"),
        11,
        "telemetry sample 6 expected at t=6, found t=5",
    ),
    ("telemetry-arity", replace_line(11, "[6,16.21,0.95,52.1]"), 11, "has 4 values; expected 5"),
    ("telemetry-soc-range", replace_line(11, "[6,16.21,1.5,52.1,0]"), 11, "battery_soc=1.5 at t=6 is outside [0, 1]"),
    ("telemetry-negative-power", replace_line(11, "[6,16.21,0.95,52.1,-3]"), 11, "payload_power_w=-3"),
    ("telemetry-string", replace_line(11, '[6,"16.21",0.95,52.1,0]'), 11, "must be a number or null"),
    ("telemetry-stops-early", delete_line(19), 18, "telemetry stops early: expected 13 samples"),
    ("telemetry-without-period", edit_header(telemetry_period_s=None), 3, "telemetry_period_s is null"),
    ("blank-line", insert_before(5, ""), 5, "blank line"),
    ("carriage-return", replace_line(4, "[1,16.2,0.95,47.2,15]\r"), 4, "carriage return"),
]


@pytest.mark.parametrize("mutation,line,fragment", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_validator_reports_file_and_line(tmp_path: Path, example_lines, mutation, line, fragment):
    path = write_lines(tmp_path / "broken.jsonl", mutation(example_lines))
    problems = validate(path)
    assert problems, "a broken trace validated"
    located = [p for p in problems if p.line == line and fragment in p.message]
    assert located, f"expected line {line} with {fragment!r}, got:\n" + "\n".join(map(str, problems))
    assert all(p.file == str(path) for p in problems)
    with pytest.raises(TraceError) as caught:
        load(path)
    first = problems[0]
    assert str(caught.value) == f"{path}:{first.line}: {first.message}"
    assert caught.value.problems == problems


@pytest.mark.parametrize(
    "data,line,fragment",
    [
        (b"", 0, "empty file"),
        (b"\xef\xbb\xbf", 1, "byte-order mark"),
        (None, 19, "does not end with a newline"),
        (b'{"format":"orbitweaver-trace"\xff}\n', 1, "not valid UTF-8"),
    ],
    ids=["empty", "bom", "truncated", "not-utf8"],
)
def test_file_level_problems(tmp_path: Path, example_lines, data, line, fragment):
    path = tmp_path / "file.jsonl"
    if data is None:
        path.write_text("\n".join(example_lines), encoding="utf-8")  # last newline missing
    elif data == b"\xef\xbb\xbf":
        path.write_bytes(data + "".join(line + "\n" for line in example_lines).encode())
    else:
        path.write_bytes(data)
    problems = validate(path)
    assert any(p.line == line and fragment in p.message for p in problems), problems


def test_missing_file_is_a_problem_at_line_zero(tmp_path: Path):
    path = tmp_path / "absent.jsonl"
    problems = validate(path)
    assert len(problems) == 1 and problems[0].line == 0 and "cannot read" in problems[0].message
    with pytest.raises(TraceError, match=re.escape(f"{path}:0: cannot read")):
        load(path)


def test_validator_reports_every_problem_in_line_order(tmp_path: Path, example_lines):
    lines = replace_line(11, "[6,16.21,1.5,52.1,0]")(example_lines)
    lines = replace_line(17, '{"type":"cut","t":11,"cause":"solar","lead_s":0}')(lines)
    problems = validate(write_lines(tmp_path / "two.jsonl", lines))
    assert [p.line for p in problems][:2] == [11, 17]


def test_example_is_valid_and_round_trips_byte_for_byte(example_path: Path):
    assert validate(example_path) == []
    trace = load(example_path)
    assert dumps(trace) == example_path.read_text(encoding="utf-8")
    assert [w.length_s for w in trace.windows()] == [5.0, 3.0]
    assert trace.windows()[0] == PowerWindow(0.0, 5.0, CutCause.THERMAL, 2.0)


def test_documented_example_is_valid_and_matches_its_description():
    doc = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
    example = doc.read_text(encoding="utf-8").split("## 5. Example")[1].split("```")[1].lstrip("\n")
    trace = loads(example, file=str(doc))
    stats = trace.stats()
    assert (stats.windows, stats.cuts, stats.warned_cuts) == (2, 2, 1)
    assert dict(stats.cuts_by_cause) == {"power": 0, "thermal": 1, "fdir": 1, "contention": 0}
    assert round(100 * stats.duty_cycle, 1) == 66.7


def test_dump_refuses_an_invalid_trace_and_writes_valid_ones(tmp_path: Path):
    bad = Trace.from_windows("bad", 10.0, [PowerWindow(0.0, 20.0, CutCause.POWER)])
    with pytest.raises(TraceError, match="outside the trace"):
        traces.dump(bad, tmp_path / "bad.jsonl")
    assert not (tmp_path / "bad.jsonl").exists()
    good = Trace.from_windows("good", 10.0, [PowerWindow(1.0, 4.0, CutCause.POWER, 2.0)])
    path = traces.dump(good, tmp_path / "sub" / "good.jsonl")
    assert path.read_text(encoding="utf-8") == dumps(good)
    assert load(path) == good
    assert [p.name for p in path.parent.iterdir()] == ["good.jsonl"]  # no temp files left behind


def test_load_accepts_a_shipped_name():
    assert load("trace-a").name == "trace-a"


# ------------------------------------------------------------------------ round-trip property

MS = 1000  # times are drawn in whole milliseconds so that window ends never coincide by accident


@st.composite
def valid_traces(draw) -> Trace:
    duration_ms = draw(st.integers(min_value=500, max_value=300_000))
    period = draw(st.sampled_from([None, 0.5, 1.0, 2.0, 7.25]))
    if period is not None:
        duration_ms = min(duration_ms, int(period * MS * 400))  # keep the telemetry small
    duration = duration_ms / MS
    count = draw(st.integers(min_value=0, max_value=12))
    points = sorted(set(draw(st.lists(st.integers(0, duration_ms), min_size=count, max_size=count))))
    windows: list[PowerWindow] = []
    for start_ms, end_ms in zip(points[0::2], points[1::2], strict=False):  # an odd last point is dropped
        cause = draw(st.sampled_from(list(CutCause)))
        lead_ms = 0
        if cause is not CutCause.FDIR and draw(st.booleans()):
            lead_ms = draw(st.integers(1, end_ms - start_ms))
        windows.append(PowerWindow(start_ms / MS, end_ms / MS, cause, lead_ms / MS))
    if len(points) % 2 == 1 and points[-1] < duration_ms:
        windows.append(PowerWindow(points[-1] / MS, duration, None))
    telemetry = []
    if period is not None:
        value = st.one_of(st.none(), st.floats(0, 1, allow_nan=False))
        for k in range(int(duration // period + 1e-9) + 1):
            telemetry.append(
                TelemetrySample(
                    k * period,
                    draw(st.one_of(st.none(), st.floats(0, 100, allow_nan=False))),
                    draw(value),
                    draw(st.one_of(st.none(), st.floats(-150, 150, allow_nan=False))),
                    draw(st.one_of(st.none(), st.floats(0, 10_000, allow_nan=False))),
                )
            )
    return Trace.from_windows(
        draw(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,20}", fullmatch=True)),
        duration,
        windows,
        telemetry=telemetry,
        telemetry_period_s=period,
        reference_request_s=draw(st.floats(0.001, 1e6, allow_nan=False)),
        description=draw(st.text(max_size=40)),
        source={"kind": "manual", "note": draw(st.text(max_size=10)), "n": draw(st.integers(-5, 5))},
        assumptions=draw(st.lists(st.text(max_size=20), max_size=3)),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_traces())
def test_round_trip_property(trace: Trace):
    lines = trace_to_lines(trace)
    assert validate_lines(lines) == []
    again = parse_lines(lines)
    assert again == trace
    assert trace_to_lines(again) == lines  # canonical: writing is deterministic
    assert loads(dumps(trace)) == trace
    assert again.windows() == trace.windows()
