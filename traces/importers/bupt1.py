"""Import BUPT-1 in-orbit telemetry (../shared/data/bupt1/, see its README) as an interruption trace.

BUPT-1 is the 12U CubeSat of the TianSuan constellation carrying COTS compute payloads (Atlas
200 DK, Raspberry Pi 4B); its telemetry was published with the MobiCom'24 paper "Deciphering the
Enigma of Satellite Computing with COTS Devices" (arXiv 2401.03435). Two of its experiments give
the two segments of the trace, back to back:

Segment 1, trace time [0, 7200): the 2-hour energy log of 2023-03-02 00:00-02:00.
  - `energy_shortterm_all.csv`: one row per second (60 rows per minute-resolution timestamp):
    bus voltage `Total_U` (mV), battery voltage `Battery_U` (mV; only rows whose `BATTERY_Group`
    is 0 or 2 carry a reading, the others hold 0).
  - `energy_shortterm_payload.csv`: one row per 2 s (30 per minute): `I_Atlas200DK-B` (mA), the
    only compute payload that ran in this window.
  Payload temperature was not logged: `payload_temp_c` is null.

Segment 2, trace time [7200, end]: an excerpt of the extreme-temperature (overheating) test, from
`overheat_from_min` (default 420 min, while the payload heats from 23 °C) to the end of the log
(553 min), which holds the payload's switch-off at 30 °C and its cool-down.
  - `overheating_telemetry_power.csv`: `TIME` (minutes), `I_Atlas200DK-B` (mA) every 2 s.
  - `overheating_telemetry_temperature.csv`: `TIME` (minutes), `ATLAS_B_TEMP` (°C, surface) every
    4 s. Bus voltage and battery were not in this test's files: both are null.
  The payload had been running since minute 0.03; the excerpt starts with it on, so the
  segment's first `power_on` marks the start of the excerpt, not a switch-on in orbit. (The full
  553-minute test would not fit the 1 MiB budget of a shipped trace at 1 Hz.)

How each quantity is derived (every number is a parameter of `Bupt1Import`):
  - Payload on/off: on while `I_Atlas200DK-B` > 100 mA (readings are 0 when off and 440-680 mA
    when on, so any threshold in between gives the same windows). A switch happens at the first
    sample on the other side of the threshold.
  - Cut cause: `thermal` when the payload temperature at the switch-off is at or above 30 °C, the
    temperature at which the overheating test's payload was switched off (ATLAS_B_TEMP first
    read 30 °C at 530.7 min; switch-off at 537.4 min). Other switch-offs carry no reason in the
    log; they are attributed to `power` (the platform's energy management switches payloads).
  - Warnings: none — the logs record no shutdown notice, so every cut has lead 0.
  - Payload power: current × 12 V. The Atlas 200 DK sits on a 12 V rail: the dataset's own
    analysis (Energy-ShortTerm/plot-section4-figure11.py) computes payload power as
    `I_Atlas200DK-B * 12 / 1000`, and the bus current drops by 0.45 A at 16 V (7.2 W) when the
    580 mA payload switches off at 5884 s, which matches 580 mA × 12 V = 7.0 W.
  - Battery state of charge: from `Battery_U` through the BUPT-1 pack's ground discharge curve
    (`traces.generator.BUPT1_PACK_OCV`). The telemetry quantizes the battery voltage to 0.2 V and
    the voltage is read under load, so this estimate is coarse (steps of 0.03-0.08).
  - 1 Hz resampling: each second takes the latest reading at or before it (what a bus publishing
    its housekeeping at 1 Hz would show); nothing is interpolated.
"""
from __future__ import annotations

import csv
import hashlib
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from traces.generator import BUPT1_PACK_OCV, soc_from_voltage
from traces.model import CutCause, Event, EventKind, TelemetrySample, Trace

DATA_ENV_VAR = "OW_BUPT1_DATA"
ENERGY_ALL = "energy_shortterm_all.csv"
ENERGY_PAYLOAD = "energy_shortterm_payload.csv"
OVERHEAT_POWER = "overheating_telemetry_power.csv"
OVERHEAT_TEMPERATURE = "overheating_telemetry_temperature.csv"
INPUT_FILES = (ENERGY_ALL, ENERGY_PAYLOAD, OVERHEAT_POWER, OVERHEAT_TEMPERATURE)
ENERGY_SEGMENT_S = 7200  # 2023-03-02 00:00-02:00, 120 minute stamps x 60 rows


class Bupt1DataError(ValueError):
    """Malformed or missing BUPT-1 input; str is `file:line: message`."""


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """$OW_BUPT1_DATA if set, else ../shared/data/bupt1 relative to the repository root."""
    override = os.environ.get(DATA_ENV_VAR)
    if override:
        return Path(override)
    return repo_root().parent / "shared" / "data" / "bupt1"


@dataclass(frozen=True)
class Bupt1Import:
    """Importer parameters (recorded in the trace header)."""

    payload_on_threshold_ma: float = 100.0
    payload_rail_v: float = 12.0
    thermal_cut_c: float = 30.0
    unexplained_cut_cause: str = CutCause.POWER.value
    overheat_from_min: float = 420.0
    reference_request_s: float = 180.0
    name: str = "bupt1"


# ------------------------------------------------------------------------------------ CSV input


def _read_csv(path: Path, required: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """Rows with their file line numbers. Handles the UTF-8 byte-order mark of some files."""
    try:
        handle = path.open(encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise Bupt1DataError(f"{path}:0: cannot read: {exc.strerror or exc}") from exc
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in required if c not in (reader.fieldnames or [])]
        if missing:
            raise Bupt1DataError(f"{path}:1: missing column(s) {', '.join(missing)}")
        return [(reader.line_num, row) for row in reader]


def _number(path: Path, line: int, row: dict[str, str], column: str) -> float:
    text = row.get(column)
    try:
        value = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise Bupt1DataError(f"{path}:{line}: column {column} is not a number: {text!r}") from None
    if not math.isfinite(value):
        raise Bupt1DataError(f"{path}:{line}: column {column} is not finite: {text!r}")
    return value


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hold(samples: Sequence[tuple[float, float]], times: Sequence[int]) -> list[float | None]:
    """For each time, the latest sample value at or before it (None before the first sample).
    `samples` is sorted by time; times are ascending."""
    out: list[float | None] = []
    index = -1
    for t in times:
        while index + 1 < len(samples) and samples[index + 1][0] <= t + 1e-6:
            index += 1
        out.append(samples[index][1] if index >= 0 else None)
    return out


def _switches(samples: Sequence[tuple[float, float]], threshold: float) -> list[tuple[float, bool]]:
    """(time, on) at each crossing of the payload-current threshold, starting from off."""
    out: list[tuple[float, bool]] = []
    on = False
    for t, current in samples:
        now_on = current > threshold
        if now_on != on:
            out.append((t, now_on))
            on = now_on
    return out


# ------------------------------------------------------------------------------------ segments


@dataclass
class _Segment:
    duration_s: int  # samples at 0..duration_s-1 (the next segment starts at duration_s)
    switches: list[tuple[float, bool]]
    voltage: list[float | None]
    soc: list[float | None]
    temperature: list[float | None]
    temperature_samples: list[tuple[float, float]]
    payload_power: list[float | None]


def _energy_segment(data_dir: Path, params: Bupt1Import) -> _Segment:
    path_all = data_dir / ENERGY_ALL
    path_payload = data_dir / ENERGY_PAYLOAD
    rows = _read_csv(path_all, ("Time", "Total_U", "BATTERY_Group", "Battery_U"))
    if len(rows) != ENERGY_SEGMENT_S:
        raise Bupt1DataError(f"{path_all}:0: expected {ENERGY_SEGMENT_S} rows (2 h at 1 Hz), found {len(rows)}")
    voltage: list[float | None] = []
    battery: list[tuple[float, float]] = []
    for second, (line, row) in enumerate(rows):
        voltage.append(_number(path_all, line, row, "Total_U") / 1000.0)
        group = _number(path_all, line, row, "BATTERY_Group")
        reading = _number(path_all, line, row, "Battery_U")
        if group in (0.0, 2.0) and reading > 0:  # groups 1 and 3 carry no battery reading
            battery.append((float(second), reading / 1000.0))
    payload_rows = _read_csv(path_payload, ("Time", "I_Atlas200DK-B"))
    if len(payload_rows) != ENERGY_SEGMENT_S // 2:
        raise Bupt1DataError(f"{path_payload}:0: expected {ENERGY_SEGMENT_S // 2} rows (2 h every 2 s), "
                             f"found {len(payload_rows)}")
    current = [
        (2.0 * index, _number(path_payload, line, row, "I_Atlas200DK-B"))
        for index, (line, row) in enumerate(payload_rows)
    ]
    times = list(range(ENERGY_SEGMENT_S))
    battery_v = _hold(battery, times)
    payload_ma = _hold(current, times)
    return _Segment(
        duration_s=ENERGY_SEGMENT_S,
        switches=_switches(current, params.payload_on_threshold_ma),
        voltage=voltage,
        soc=[None if v is None else soc_from_voltage(v) for v in battery_v],
        temperature=[None] * ENERGY_SEGMENT_S,
        temperature_samples=[],
        payload_power=[None if i is None else i * params.payload_rail_v / 1000.0 for i in payload_ma],
    )


def _overheat_segment(data_dir: Path, params: Bupt1Import) -> _Segment:
    path_power = data_dir / OVERHEAT_POWER
    path_temp = data_dir / OVERHEAT_TEMPERATURE
    offset_s = params.overheat_from_min * 60.0

    def timed(path: Path, column: str) -> list[tuple[float, float]]:
        out = []
        for line, row in _read_csv(path, ("TIME", column)):
            # TIME is in minutes as a float; round to the millisecond to undo binary fractions.
            t = round(_number(path, line, row, "TIME") * 60.0, 3) - offset_s
            out.append((t, _number(path, line, row, column)))
        if any(b[0] < a[0] for a, b in zip(out, out[1:])):
            raise Bupt1DataError(f"{path}:0: TIME is not in ascending order")
        return out

    current_all = timed(path_power, "I_Atlas200DK-B")
    temperature_all = timed(path_temp, "ATLAS_B_TEMP")
    end_s = int(math.floor(min(current_all[-1][0], temperature_all[-1][0])))
    if end_s <= 0:
        raise Bupt1DataError(f"{path_power}:0: the log ends before overheat_from_min={params.overheat_from_min}")
    times = list(range(end_s + 1))
    payload_ma = _hold(current_all, times)
    temperature = _hold(temperature_all, times)
    # Switches inside the excerpt; the state at its start comes from the last sample before it.
    before = [c for t, c in current_all if t <= 0.0]
    inside = [(t, c) for t, c in current_all if 0.0 < t <= end_s]
    switches = _switches(([(0.0, before[-1])] if before else []) + inside, params.payload_on_threshold_ma)
    return _Segment(
        duration_s=end_s,
        switches=switches,
        voltage=[None] * len(times),
        soc=[None] * len(times),
        temperature=temperature,
        temperature_samples=[s for s in temperature_all if s[0] <= end_s],
        payload_power=[None if i is None else i * params.payload_rail_v / 1000.0 for i in payload_ma],
    )


def _temperature_at(samples: Sequence[tuple[float, float]], t: float) -> float | None:
    held = _hold(samples, [t]) if samples else [None]
    return held[0]


def _window_minutes(events: Sequence[Event], duration_s: float) -> tuple[float, float]:
    """Lengths in minutes of the first two windows (for the description)."""
    lengths = []
    start = None
    for event in events:
        if event.kind is EventKind.POWER_ON:
            start = event.t_s
        elif event.kind is EventKind.CUT and start is not None:
            lengths.append((event.t_s - start) / 60.0)
            start = None
    if start is not None:
        lengths.append((duration_s - start) / 60.0)
    lengths += [0.0, 0.0]
    return lengths[0], lengths[1]


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


# ------------------------------------------------------------------------------------ import


def import_bupt1(data_dir: str | os.PathLike[str] | None = None, params: Bupt1Import = Bupt1Import()) -> Trace:
    """Build the BUPT-1 trace from the four CSV files in `data_dir` (default: `default_data_dir()`)."""
    directory = Path(data_dir) if data_dir is not None else default_data_dir()
    if not directory.is_dir():
        raise Bupt1DataError(f"{directory}:0: BUPT-1 data folder not found (set ${DATA_ENV_VAR} or pass --data)")
    unexplained = CutCause(params.unexplained_cut_cause)
    energy = _energy_segment(directory, params)
    overheat = _overheat_segment(directory, params)

    events: list[Event] = []
    telemetry: list[TelemetrySample] = []
    offset = 0
    segments = (energy, overheat)
    for number, segment in enumerate(segments):
        last = number == len(segments) - 1
        on = False
        for t, now_on in segment.switches:
            at = offset + t
            if now_on:
                events.append(Event(float(at), EventKind.POWER_ON))
            else:
                temp = _temperature_at(segment.temperature_samples, t)
                cause = CutCause.THERMAL if temp is not None and temp >= params.thermal_cut_c else unexplained
                events.append(Event(float(at), EventKind.CUT, cause, 0.0))
            on = now_on
        if on and not last:
            raise Bupt1DataError(
                f"{directory}:0: the payload is still on at the end of segment {number + 1}; segments "
                "can only be joined while it is off"
            )
        count = segment.duration_s + (1 if last else 0)
        for k in range(count):
            telemetry.append(
                TelemetrySample(
                    float(offset + k),
                    _round(segment.voltage[k], 3),
                    _round(segment.soc[k], 3),
                    _round(segment.temperature[k], 1),
                    _round(segment.payload_power[k], 2),
                )
            )
        offset += segment.duration_s

    inputs = {name: {"sha256": _sha256(directory / name)} for name in INPUT_FILES}
    first_window_min, second_window_min = _window_minutes(events, offset)
    excerpt_min = overheat.duration_s / 60.0
    return Trace(
        name=params.name,
        description=(
            "Real in-orbit telemetry from the BUPT-1 12U CubeSat (TianSuan constellation, MobiCom'24 "
            f"dataset). Segment 1 (0-{ENERGY_SEGMENT_S} s): 2 h of platform power telemetry on 2023-03-02 "
            f"during which the Atlas 200 DK payload ran for {first_window_min:.1f} min, starting in eclipse, "
            f"and was switched off by the platform. Segment 2 ({ENERGY_SEGMENT_S}-{offset} s): the last "
            f"{excerpt_min:.0f} min of an extreme-temperature test in which the running payload heated to "
            f"{params.thermal_cut_c:g} C and was switched off ({second_window_min:.1f} min into the excerpt), "
            "then cooled."
        ),
        duration_s=float(offset),
        events=tuple(events),
        telemetry=tuple(telemetry),
        telemetry_period_s=1.0,
        reference_request_s=params.reference_request_s,
        time_scale=1.0,
        source={
            "kind": "import",
            "importer": "traces.importers.bupt1.import_bupt1",
            "dataset": "BUPT-1 telemetry, TiansuanConstellation/MobiCom24-SatelliteCOTS (arXiv 2401.03435)",
            "inputs": inputs,
            "parameters": asdict(params),
            "segments": [
                {"trace_start_s": 0, "trace_end_s": ENERGY_SEGMENT_S,
                 "from": f"{ENERGY_ALL}, {ENERGY_PAYLOAD}", "log_time": "2023-03-02 00:00-02:00"},
                {"trace_start_s": ENERGY_SEGMENT_S, "trace_end_s": offset,
                 "from": f"{OVERHEAT_POWER}, {OVERHEAT_TEMPERATURE}",
                 "log_time": f"test minutes {params.overheat_from_min:g}-{params.overheat_from_min + overheat.duration_s / 60:.1f}"},
            ],
            "battery_curve_soc_v": [list(point) for point in BUPT1_PACK_OCV],
        },
        assumptions=(
            "Payload on while I_Atlas200DK-B > 100 mA (readings are 0 off, 440-680 mA on).",
            "Payload power = I_Atlas200DK-B x 12 V (the Atlas 200 DK's 12 V rail, as in the dataset's "
            "plot-section4-figure11.py; the bus current falls 0.45 A at 16 V when the 580 mA payload "
            "switches off at 5884 s, i.e. 7.2 W vs 7.0 W).",
            "A switch-off is thermal when the payload surface temperature is >= 30 C (the overheating "
            "test's payload was switched off at 30 C: first 30 C reading at 530.7 min, switch-off at "
            "537.4 min); other switch-offs carry no reason in the log and are attributed to the "
            "platform's power budget (cause power).",
            "No warnings: the logs record no shutdown notice (all leads 0).",
            "Battery state of charge from Battery_U (groups 0 and 2; 0.2 V steps, read under load) "
            "through the BUPT-1 pack's ground discharge curve (115 Wh; 16.26 V full, 12.36 V empty).",
            "1 Hz telemetry holds the latest reading at or before each second; nothing is interpolated. "
            "Bus voltage and battery are null in segment 2 and payload temperature is null in segment 1 "
            "(not in those logs).",
            "Segment 2 starts at minute 420 of the test with the payload already on: its first power_on "
            "is the start of the excerpt, not a switch-on in orbit.",
            "Window lengths against the 180 s reference request: both windows are long (tens of "
            "minutes, over 10 requests each): BUPT-1 runs its payload in long sessions.",
        ),
    )
