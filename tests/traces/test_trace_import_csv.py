"""`trace-import-csv`: the real BUPT-1 files through the generic importer give the shipped trace (and
`trace-import-bupt1`, now its preset, the same bytes); damaged copies of them are reported with file
and line, stopping or warning as docs/trace-format.md section 10 says; the other BUPT-1 layouts
(Unix time stamps, two payloads side by side, multiplexed temperature and solar channels); the bus
plays an imported trace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from trace_testkit import run

from common.cli import CliError
from traces import CutCause, load, shipped_path
from traces.format import validate
from traces.importers import bupt1
from traces.importers.bupt1 import default_data_dir

DATA = default_data_dir()
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"BUPT-1 data folder {DATA} is absent")

ENERGY = [
    "--time",
    "Time",
    "--time-unit",
    "datetime",
    "--spread-repeats",
    "--current",
    "I_Atlas200DK-B",
    "--on-above",
    "100",
    "--voltage",
    "Total_U",
    "--voltage-unit",
    "mV",
    "--battery",
    "Battery_U",
    "--battery-unit",
    "mV",
    "--no-reading",
    "Battery_U=0",
    "--payload-volts",
    "12",
]
OVERHEAT = [
    "--time",
    "TIME",
    "--time-unit",
    "min",
    "--current",
    "I_Atlas200DK-B",
    "--on-above",
    "100",
    "--temperature",
    "ATLAS_B_TEMP",
    "--thermal-at",
    "30",
    "--payload-volts",
    "12",
]


def import_csv_cli(files, options, out: Path, *extra: str) -> int:
    return run(["trace-import-csv", *map(str, files), *options, *extra, "--out", str(out)])


def failure(files, options, out: Path, *extra: str) -> CliError:
    with pytest.raises(CliError) as error:
        import_csv_cli(files, options, out, *extra)
    assert not out.exists(), "a failed import wrote a trace"
    return error.value


# ------------------------------------------------------------------------------ the real files


@needs_data
def test_the_generic_importer_turns_the_bupt1_files_into_the_shipped_trace(tmp_path, capsys):
    energy, overheat = tmp_path / "energy.jsonl", tmp_path / "overheat.jsonl"
    assert import_csv_cli([DATA / bupt1.ENERGY_ALL, DATA / bupt1.ENERGY_PAYLOAD], ENERGY, energy) == 0
    assert (
        import_csv_cli(
            [DATA / bupt1.OVERHEAT_POWER, DATA / bupt1.OVERHEAT_TEMPERATURE], OVERHEAT, overheat, "--from", "25200"
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "warning" not in err, err
    assert "the payload is on at the start" in err  # the excerpt's first power_on, said out loud
    assert validate(energy) == [] and validate(overheat) == []
    assert run(["trace-info", str(overheat)]) == 0
    assert "cuts         1: power 0, thermal 1" in capsys.readouterr().out
    joined, shipped = load(energy).concat(load(overheat)), load("bupt1")
    assert joined.events == shipped.events
    assert joined.telemetry == shipped.telemetry
    # the dedicated command is now a preset of the generic importer, with the same bytes as before
    preset = tmp_path / "bupt1.jsonl"
    assert run(["trace-import-bupt1", "--data", str(DATA), "--out", str(preset)]) == 0
    assert preset.read_bytes() == shipped_path("bupt1").read_bytes()
    assert [files for files, _ in bupt1.preset()] == [
        (bupt1.ENERGY_ALL, bupt1.ENERGY_PAYLOAD),
        (bupt1.OVERHEAT_POWER, bupt1.OVERHEAT_TEMPERATURE),
    ]


def _copy(source: Path, target: Path, lines: int, edit=None) -> Path:
    """The first `lines` lines of a real file (its byte-order mark kept), edited."""
    text = source.read_text(encoding="utf-8-sig")
    rows = text.splitlines()[:lines]
    if edit is not None:
        edit(rows)
    bom = "\ufeff" if source.read_bytes().startswith(b"\xef\xbb\xbf") else ""
    target.write_text(bom + "\n".join(rows) + "\n", encoding="utf-8")
    return target


@pytest.fixture
def overheat_copy(tmp_path):
    """First 10 minutes of the overheating test (power every 2 s, temperature every 4 s)."""
    if not DATA.is_dir():
        pytest.skip(f"BUPT-1 data folder {DATA} is absent")

    def make(power_edit=None, temperature_edit=None):
        power = _copy(DATA / bupt1.OVERHEAT_POWER, tmp_path / "power.csv", 301, power_edit)
        temperature = _copy(DATA / bupt1.OVERHEAT_TEMPERATURE, tmp_path / "temperature.csv", 151, temperature_edit)
        return [power, temperature]

    return make


def _set(line: int, text: str):
    def edit(rows):
        rows[line - 1] = text

    return edit


def _cell(line: int, text: str):
    """Replace the value (second cell) of a line, keeping its time stamp."""

    def edit(rows):
        rows[line - 1] = rows[line - 1].split(",")[0] + "," + text

    return edit


@pytest.mark.parametrize(
    "damage, file_index, line, message",
    [
        (dict(temperature_edit=_cell(5, "hot")), 1, 5, "column ATLAS_B_TEMP is not a number: 'hot'"),
        (dict(temperature_edit=_cell(5, "nan")), 1, 5, "column ATLAS_B_TEMP is not a finite number"),
        (dict(temperature_edit=_cell(7, "300")), 1, 7, "temperature 300 C is outside the trace format's range"),
        (
            dict(power_edit=lambda rows: rows.__setitem__(slice(10, 12), [rows[11], rows[10]])),
            0,
            12,
            "time goes backward: TIME is at 18 s here but at 20 s on line 11",
        ),
        (dict(temperature_edit=_set(1, "TIME,ATLAS_TEMP")), 0, 1, "missing column(s) ATLAS_B_TEMP"),
        (dict(power_edit=_cell(40, "580,1")), 0, 40, "3 cells, the header has 2 columns"),
    ],
    ids=["not-a-number", "nan", "out-of-range", "backward-time", "missing-column", "extra-cell"],
)
def test_damaged_copies_stop_with_file_and_line(overheat_copy, tmp_path, damage, file_index, line, message):
    files = overheat_copy(**damage)
    error = failure(files, OVERHEAT, tmp_path / "out.jsonl")
    assert error.code == 1
    assert str(error).startswith(f"{files[file_index]}:{line}: {message}"), str(error)


def test_gaps_repeats_and_empty_cells_are_warnings_and_the_import_goes_on(overheat_copy, tmp_path, capsys):
    def damage_power(rows):
        rows[20] = rows[19].split(",")[0] + ",580"  # line 21 repeats line 20's time stamp
        del rows[100:160]  # two minutes missing after line 100

    files = overheat_copy(power_edit=damage_power, temperature_edit=_cell(30, ""))
    out = tmp_path / "out.jsonl"
    assert import_csv_cli(files, OVERHEAT, out) == 0
    err = capsys.readouterr().err.splitlines()
    power, temperature = files
    assert (
        f"{power}:21: warning: same time stamp as line 20: the later row is the reading at that time "
        "(--spread-repeats takes such rows as evenly spaced samples)" in err
    )
    assert (
        f"{power}:101: warning: gap of 122 s after line 100 (more than 4 s): the reading of line 100 is "
        "held across it" in err
    )
    assert (
        f"{temperature}:30: warning: column ATLAS_B_TEMP is empty: no reading in this row (the previous "
        "one holds)" in err
    )
    assert validate(out) == []
    trace = load(out)
    # the reading before the gap holds through it: nothing interpolated
    before_gap = trace.telemetry[196]
    assert all(s.payload_power_w == before_gap.payload_power_w for s in trace.telemetry[196:318])


def test_an_excerpt_outside_the_data_is_refused(overheat_copy, tmp_path):
    files = overheat_copy()
    late = failure(files, OVERHEAT, tmp_path / "o", "--to", "700")
    assert "is after the end of the data (log time 596 s)" in str(late)
    assert "has no reading at or before the start" in str(failure(files, OVERHEAT, tmp_path / "o", "--from", "-10"))
    wrong = failure(
        files,
        ["--time", "TIME", "--current", "I_Atlas200DK-B", "--on-above", "100", "--thermal-at", "30"],
        tmp_path / "o",
    )
    assert wrong.code == 2 and "--thermal-at needs --temperature" in str(wrong)


def test_non_finite_numbers_are_refused_as_options(tmp_path):
    """Issue 27, finding 8 (other commands checked the same way): `--from nan` and `--thermal-at
    nan` were tracebacks (a NaN turned into an integer, a NaN in the trace's JSON header)."""
    csv = tmp_path / "log.csv"
    csv.write_text("t,mA,C\n" + "".join(f"{i},{500 if i % 100 < 50 else 0},{30 + i % 20}\n" for i in range(300)))
    options = ["--time", "t", "--current", "mA", "--on-above", "100", "--temperature", "C"]
    for option in ("--from", "--to", "--max-gap", "--thermal-at", "--payload-volts"):
        for value in ("nan", "inf"):
            refused = failure([csv], options, tmp_path / "o.jsonl", option, value)
            assert refused.code == 2 and f"{option} must be a finite number, not {value}" in str(refused)
    assert import_csv_cli([csv], options, tmp_path / "o.jsonl") == 0  # the same file, good options


def test_minute_stamps_repeat_unless_spread_and_uneven_minutes_are_reported(tmp_path, capsys):
    if not DATA.is_dir():
        pytest.skip(f"BUPT-1 data folder {DATA} is absent")
    energy = [
        _copy(DATA / bupt1.ENERGY_ALL, tmp_path / "all.csv", 601),
        _copy(DATA / bupt1.ENERGY_PAYLOAD, tmp_path / "payload.csv", 301),
    ]
    out = tmp_path / "out.jsonl"
    no_spread = [option for option in ENERGY if option != "--spread-repeats"]
    assert import_csv_cli(energy, no_spread, out) == 0
    err = capsys.readouterr().err
    assert f"{energy[0]}:3: warning: same time stamp as line 2" in err
    assert f"{energy[0]}:0: warning: 585 more repeated time stamps not listed (590 in all)" in err
    assert load(out).duration_s == 540  # the last minute's stamp is its last reading

    energy[0] = _copy(DATA / bupt1.ENERGY_ALL, tmp_path / "all.csv", 601, lambda rows: rows.__delitem__(200))
    assert import_csv_cli(energy, ENERGY, out) == 0
    err = capsys.readouterr().err
    assert f"{energy[0]}:182: warning: 59 rows share this time stamp where 60 usually do" in err
    seconds = [option if option != "datetime" else "s" for option in ENERGY]
    assert "is a date-time, not a number in s: '2023/3/2 00:00' (--time-unit datetime)" in str(
        failure(energy, seconds, tmp_path / "s")
    )
    voltage_in_volts = [option if option != "mV" else "V" for option in ENERGY]
    assert "is the column in mV? (--voltage-unit mV)" in str(failure(energy, voltage_in_volts, tmp_path / "v"))


# ------------------------------------------------------------------------------ other layouts


def _side_by_side(path: Path) -> Path:
    """The layout of BUPT-1's atlasAB_surtemp.csv: Unix time stamps, two payloads' currents and
    temperatures side by side, two solar channels, temperatures multiplexed (0 in rows that carry
    no reading). Atlas B runs from 3 s until it reaches 30 C at 150 s; Atlas A from 50 s to 100 s."""
    lines = [
        "TIME,ATLAS_A_TEMP,ATLAS_B_TEMP,PI_A_TEMP,MPPT1_Uin,MPPT1_Iin,MPPT2_Uin,MPPT2_Iin,I_Atlas200DK-A,I_Atlas200DK-B"
    ]
    for i in range(200):
        sampled = i % 4 < 2
        temp_a, temp_b = (10.0 + i / 50, 2.0 + 29 * min(i, 150) / 150) if sampled else (0.0, 0.0)
        current_a = 600.0 if 50 <= i < 100 else 0.0
        current_b = 620.0 if 3 <= i < 150 else 0.0
        lines.append(
            f"{1690106650 + i},{temp_a:.1f},{temp_b:.1f},{1.0 if sampled else 0.0},16000.0,110.0,15600.0,"
            f"1970.0,{current_a},{current_b}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_unix_time_two_payloads_side_by_side_and_multiplexed_temperatures(tmp_path, capsys):
    log = _side_by_side(tmp_path / "atlasAB_surtemp.csv")
    common = ["--time", "TIME", "--time-unit", "unix", "--on-above", "100", "--thermal-at", "30"]
    b, a = tmp_path / "b.jsonl", tmp_path / "a.jsonl"
    assert (
        import_csv_cli(
            [log],
            common + ["--current", "I_Atlas200DK-B", "--temperature", "ATLAS_B_TEMP", "--no-reading", "ATLAS_B_TEMP=0"],
            b,
        )
        == 0
    )
    assert (
        import_csv_cli(
            [log],
            common
            + [
                "--current",
                "I_Atlas200DK-A",
                "--temperature",
                "ATLAS_A_TEMP",
                "--no-reading",
                "ATLAS_A_TEMP=0",
                "--name",
                "atlas-a",
            ],
            a,
        )
        == 0
    )
    notes = capsys.readouterr().err
    assert "log time 0 is the first time stamp, 1690106650 s after 1970-01-01 UTC (2023-07-23 10:04:10 UTC)" in notes
    trace_b, trace_a = load(b), load(a)
    assert trace_b.name == "atlasab_surtemp" and trace_a.name == "atlas-a"
    assert [(w.start_s, w.end_s, w.cut_cause) for w in trace_b.windows()] == [(3.0, 150.0, CutCause.THERMAL)]
    assert [(w.start_s, w.end_s, w.cut_cause) for w in trace_a.windows()] == [(50.0, 100.0, CutCause.POWER)]
    # a multiplexed 0 is not a reading: the temperature holds instead of dropping to 0 every other pair of rows
    assert all(s.payload_temp_c >= 2.0 for s in trace_b.telemetry)
    assert trace_b.telemetry[0].bus_voltage_v is None and trace_b.telemetry[0].battery_soc is None
    # without that option the cut at a multiplexed 0 would not be recognised as thermal: the log is read
    # as written, so the option is needed and documented
    plain = tmp_path / "plain.jsonl"
    assert import_csv_cli([log], common + ["--current", "I_Atlas200DK-B", "--temperature", "ATLAS_B_TEMP"], plain) == 0
    assert load(plain).cuts()[0].cause is CutCause.POWER


def test_the_bus_plays_an_imported_trace(tmp_path):
    from common.wire.link import Endpoints, init_keys
    from hil.bus import BusConfig, BusThread
    from hil.bus import buslog as bl

    log = _side_by_side(tmp_path / "atlasAB_surtemp.csv")
    trace = tmp_path / "b.jsonl"
    assert (
        import_csv_cli(
            [log],
            [
                "--time",
                "TIME",
                "--time-unit",
                "unix",
                "--on-above",
                "100",
                "--current",
                "I_Atlas200DK-B",
                "--temperature",
                "ATLAS_B_TEMP",
                "--thermal-at",
                "30",
                "--no-reading",
                "ATLAS_B_TEMP=0",
                "--payload-volts",
                "12",
            ],
            trace,
        )
        == 0
    )
    init_keys(tmp_path / "keys")
    cfg = BusConfig(
        trace=str(trace),
        data_dir=tmp_path / "bus",
        keys_dir=tmp_path / "keys",
        time_scale=0.02,
        endpoints=Endpoints("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"),
        payload_command=["sleep", "600"],
        boot_timeout_s=0,
        heartbeat_timeout_s=0,
        stop_at_end=True,
    )
    bus = BusThread(cfg).start()
    try:
        # the trace's 199 s at 0.02 wall s per trace s, then the bus stops itself (a hang guard only)
        bus._thread.join(600)
        assert not bus._thread.is_alive(), "the bus never reached the trace's end"
    finally:
        bus.stop()
    entries = bl.read_log(tmp_path / "bus" / bl.LOG_FILE)
    power = [(e.kind, e.data.get("cause"), e.trace_s) for e in entries if e.kind in (bl.POWER_ON, bl.POWER_OFF)]
    assert [(kind, cause) for kind, cause, _ in power[:2]] == [(bl.POWER_ON, "restored"), (bl.POWER_OFF, "thermal")]
    # Stamped when the switch has acted: at the trace's instant (3 s on, 150 s off) or a little
    # after it on a loaded machine (10 trace s = 0.2 s wall here), never before.
    for (_, _, stamped), scheduled in zip(power[:2], (3, 150), strict=True):
        assert scheduled - 0.5 <= stamped < scheduled + 10, power
    assert any(e.kind == bl.TRACE_END for e in entries)


def test_help_explains_the_mapping(capsys):
    with pytest.raises(SystemExit):
        run(["trace-import-csv", "--help"])
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    for phrase in (
        "--on-above MILLIAMPS",
        "--time-unit {s,min,ms,unix,datetime}",
        "latest reading at or before",
        "FILE:LINE",
        "--spread-repeats",
        "examples",
    ):
        assert phrase in text
