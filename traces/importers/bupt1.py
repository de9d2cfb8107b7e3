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

The import is a preset of the generic CSV importer (`traces.importers.csv_import`, the same as
`ow hil trace-import-csv`): `preset(params)` gives its column mapping for each segment, and the
two imported segments are joined. How each quantity is derived (every number is a parameter of
`Bupt1Import`):
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
    the voltage is read under load, so this estimate is coarse (steps of 0.03-0.08). Rows that
    carry no battery reading (battery groups 1 and 3) hold 0, which is therefore not a reading.
  - Time: the energy logs stamp their rows with the minute (60 rows, or 30 every 2 s, per
    stamp), taken as evenly spaced samples within it; the overheating test's `TIME` is minutes.
  - 1 Hz resampling: each second takes the latest reading at or before it (what a bus publishing
    its housekeeping at 1 Hz would show); nothing is interpolated.
"""

from __future__ import annotations

import csv
import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from traces.generator import BUPT1_PACK_OCV
from traces.importers.csv_import import CsvImport, CsvImportError, Imported, import_csv
from traces.model import Event, EventKind, Trace

DATA_ENV_VAR = "OW_BUPT1_DATA"
ENERGY_ALL = "energy_shortterm_all.csv"
ENERGY_PAYLOAD = "energy_shortterm_payload.csv"
OVERHEAT_POWER = "overheating_telemetry_power.csv"
OVERHEAT_TEMPERATURE = "overheating_telemetry_temperature.csv"
INPUT_FILES = (ENERGY_ALL, ENERGY_PAYLOAD, OVERHEAT_POWER, OVERHEAT_TEMPERATURE)
ENERGY_SEGMENT_S = 7200  # 2023-03-02 00:00-02:00, 120 minute stamps x 60 rows


class Bupt1DataError(CsvImportError):
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
    unexplained_cut_cause: str = "power"
    overheat_from_min: float = 420.0
    reference_request_s: float = 180.0
    name: str = "bupt1"


def preset(params: Bupt1Import = Bupt1Import()) -> list[tuple[tuple[str, ...], CsvImport]]:
    """The generic importer's files and column mapping for each segment, in trace order (the
    same as the `ow hil trace-import-csv` commands in docs/trace-format.md section 10)."""
    common: dict[str, Any] = dict(
        current="I_Atlas200DK-B",
        on_above_ma=params.payload_on_threshold_ma,
        payload_volts=params.payload_rail_v,
        other_cause=params.unexplained_cut_cause,
        reference_request_s=params.reference_request_s,
        name=params.name,
    )
    return [
        (
            (ENERGY_ALL, ENERGY_PAYLOAD),
            CsvImport(
                time="Time",
                time_unit="datetime",
                spread_repeats=True,
                voltage="Total_U",
                voltage_unit="mV",
                battery="Battery_U",
                battery_unit="mV",
                no_reading={"Battery_U": 0.0},
                **common,
            ),
        ),
        (
            (OVERHEAT_POWER, OVERHEAT_TEMPERATURE),
            CsvImport(
                time="TIME",
                time_unit="min",
                temperature="ATLAS_B_TEMP",
                thermal_at_c=params.thermal_cut_c,
                from_s=params.overheat_from_min * 60.0,
                **common,
            ),
        ),
    ]


def _count_rows(path: Path) -> int:
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            return sum(1 for row in csv.reader(handle) if row) - 1
    except (OSError, csv.Error) as exc:
        raise Bupt1DataError(f"{path}:0: cannot read: {exc}") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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


# ------------------------------------------------------------------------------------ import


def import_bupt1(data_dir: str | os.PathLike[str] | None = None, params: Bupt1Import = Bupt1Import()) -> Trace:
    """Build the BUPT-1 trace from the four CSV files in `data_dir` (default: `default_data_dir()`)."""
    return import_bupt1_reported(data_dir, params).trace


def import_bupt1_reported(
    data_dir: str | os.PathLike[str] | None = None, params: Bupt1Import = Bupt1Import()
) -> Imported:
    """`import_bupt1`, with the generic importer's warnings and notes for each segment."""
    directory = Path(data_dir) if data_dir is not None else default_data_dir()
    if not directory.is_dir():
        raise Bupt1DataError(f"{directory}:0: BUPT-1 data folder not found (set ${DATA_ENV_VAR} or pass --data)")
    segments: list[Imported] = []
    for files, mapping in preset(params):
        try:
            segments.append(import_csv([directory / name for name in files], mapping))
        except CsvImportError as exc:
            raise Bupt1DataError(str(exc)) from None
    for name, expected in ((ENERGY_ALL, ENERGY_SEGMENT_S), (ENERGY_PAYLOAD, ENERGY_SEGMENT_S // 2)):
        rows = _count_rows(directory / name)
        if rows != expected:
            raise Bupt1DataError(
                f"{directory / name}:0: expected {expected} rows (2 h at "
                f"{'1 Hz' if expected == ENERGY_SEGMENT_S else 'one row per 2 s'}), found {rows}"
            )
    energy, overheat = (segment.trace for segment in segments)
    if energy.duration_s != ENERGY_SEGMENT_S:
        raise Bupt1DataError(
            f"{directory / ENERGY_ALL}:0: the energy log covers {energy.duration_s:g} s, not {ENERGY_SEGMENT_S} s"
        )
    if energy.windows() and energy.windows()[-1].is_open:
        raise Bupt1DataError(
            f"{directory}:0: the payload is still on at the end of segment 1; segments "
            "can only be joined while it is off"
        )
    joined = energy.concat(overheat)
    events, offset = joined.events, int(joined.duration_s)
    inputs = {name: {"sha256": _sha256(directory / name)} for name in INPUT_FILES}
    first_window_min, second_window_min = _window_minutes(events, offset)
    excerpt_min = overheat.duration_s / 60.0
    trace = replace(
        joined,
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
        source={
            "kind": "import",
            "importer": "traces.importers.bupt1.import_bupt1",
            "dataset": "BUPT-1 telemetry, TiansuanConstellation/MobiCom24-SatelliteCOTS (arXiv 2401.03435)",
            "inputs": inputs,
            "parameters": asdict(params),
            "segments": [
                {
                    "trace_start_s": 0,
                    "trace_end_s": ENERGY_SEGMENT_S,
                    "from": f"{ENERGY_ALL}, {ENERGY_PAYLOAD}",
                    "log_time": "2023-03-02 00:00-02:00",
                },
                {
                    "trace_start_s": ENERGY_SEGMENT_S,
                    "trace_end_s": offset,
                    "from": f"{OVERHEAT_POWER}, {OVERHEAT_TEMPERATURE}",
                    "log_time": (
                        f"test minutes {params.overheat_from_min:g}-"
                        f"{params.overheat_from_min + overheat.duration_s / 60:.1f}"
                    ),
                },
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
    return Imported(
        trace, [w for segment in segments for w in segment.warnings], [n for segment in segments for n in segment.notes]
    )
