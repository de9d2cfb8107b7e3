"""BUPT-1 importer: re-importing the real telemetry reproduces the shipped trace, and the imported
trace is consistent with the raw logs."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from traces import CutCause, load, shipped_path
from traces.format import dumps, trace_problems
from traces.importers import bupt1
from traces.importers.bupt1 import Bupt1DataError, Bupt1Import, default_data_dir, import_bupt1

DATA = default_data_dir()
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"BUPT-1 data folder {DATA} is absent")


def test_data_folder_resolves_next_to_the_repository(monkeypatch):
    monkeypatch.delenv(bupt1.DATA_ENV_VAR, raising=False)
    repo = Path(__file__).resolve().parents[2]
    assert default_data_dir() == repo.parent / "shared" / "data" / "bupt1"
    monkeypatch.setenv(bupt1.DATA_ENV_VAR, "/somewhere/else")
    assert default_data_dir() == Path("/somewhere/else")


@needs_data
def test_reimport_equals_the_shipped_file():
    assert dumps(import_bupt1(DATA)) == shipped_path("bupt1").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def imported():
    if not DATA.is_dir():
        pytest.skip(f"BUPT-1 data folder {DATA} is absent")
    return import_bupt1(DATA)


def _payload_switches(path: Path, column: str, step_s: float, offset_s: float = 0.0) -> list[tuple[float, bool]]:
    """Independent reading of the raw CSV: times at which the payload current crosses 100 mA."""
    out, on = [], False
    with path.open(encoding="utf-8-sig", newline="") as handle:
        for index, row in enumerate(csv.DictReader(handle)):
            now = float(row[column]) > 100
            if now != on:
                t = index * step_s if "TIME" not in row else round(float(row["TIME"]) * 60, 3)
                out.append((t - offset_s, now))
                on = now
    return out


def test_windows_follow_the_payload_current_in_the_raw_logs(imported):
    energy = _payload_switches(DATA / bupt1.ENERGY_PAYLOAD, "I_Atlas200DK-B", 2.0)
    windows = imported.windows()
    assert [(w.start_s, True) for w in windows[:1]] + [(windows[0].end_s, False)] == energy
    overheat = _payload_switches(DATA / bupt1.OVERHEAT_POWER, "I_Atlas200DK-B", 0.0, offset_s=420 * 60)
    switch_off = [t for t, on in overheat if not on and t > 0]
    assert windows[1].start_s == bupt1.ENERGY_SEGMENT_S  # the excerpt starts with the payload on
    assert windows[1].end_s == bupt1.ENERGY_SEGMENT_S + switch_off[0]
    assert [w.cut_cause for w in windows] == [CutCause.POWER, CutCause.THERMAL]


def test_imported_telemetry_is_consistent_with_the_events(imported):
    telemetry = imported.telemetry
    thermal_cut = imported.cuts()[1]
    assert telemetry[int(thermal_cut.t_s)].payload_temp_c >= 30.0
    for sample in telemetry:
        on = imported.is_on_at(sample.t_s)
        assert (sample.payload_power_w > 0) == on, sample
        first_segment = sample.t_s < bupt1.ENERGY_SEGMENT_S
        assert (sample.bus_voltage_v is not None) == first_segment
        assert (sample.battery_soc is not None) == first_segment
        assert (sample.payload_temp_c is None) == first_segment
    # Payload power is current x 12 V: 580 mA -> 6.96 W.
    assert {round(s.payload_power_w / 12 * 1000) for s in telemetry if s.payload_power_w} >= {580}
    assert all(15.0 < s.bus_voltage_v < 17.0 for s in telemetry if s.bus_voltage_v is not None)


def test_shipped_bupt1_records_its_inputs_and_thresholds():
    trace = load("bupt1")
    assert trace.source["kind"] == "import"
    assert set(trace.source["inputs"]) == set(bupt1.INPUT_FILES)
    assert trace.source["parameters"]["thermal_cut_c"] == 30.0
    assert trace.source["parameters"]["payload_rail_v"] == 12.0


@needs_data
def test_files_without_byte_order_mark_import_the_same(tmp_path: Path, imported):
    for name in bupt1.INPUT_FILES:
        raw = (DATA / name).read_bytes()
        (tmp_path / name).write_bytes(raw.removeprefix(b"\xef\xbb\xbf"))
    again = import_bupt1(tmp_path)
    assert again.events == imported.events and again.telemetry == imported.telemetry


@needs_data
def test_env_var_selects_the_data_folder(tmp_path: Path, monkeypatch, imported):
    for name in bupt1.INPUT_FILES:
        shutil.copy(DATA / name, tmp_path / name)
    monkeypatch.setenv(bupt1.DATA_ENV_VAR, str(tmp_path))
    assert import_bupt1().events == imported.events


@needs_data
def test_malformed_input_is_reported_with_file_and_line(tmp_path: Path):
    for name in bupt1.INPUT_FILES:
        shutil.copy(DATA / name, tmp_path / name)
    path = tmp_path / bupt1.OVERHEAT_TEMPERATURE
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[4] = "0.26666666666666666,hot"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(Bupt1DataError, match=rf"^{path}:5: column ATLAS_B_TEMP is not a number: 'hot'"):
        import_bupt1(tmp_path)
    (tmp_path / bupt1.ENERGY_ALL).write_text("Time,Total_I\n2023/3/2 00:00,1\n", encoding="utf-8")
    with pytest.raises(Bupt1DataError, match=r"energy_shortterm_all.csv:1: missing column"):
        import_bupt1(tmp_path)


def test_missing_folder_is_reported(tmp_path: Path):
    with pytest.raises(Bupt1DataError, match="data folder not found"):
        import_bupt1(tmp_path / "nope")


@needs_data
def test_excerpt_start_is_a_parameter():
    later = import_bupt1(DATA, Bupt1Import(overheat_from_min=500.0))
    assert trace_problems(later) == []
    assert later.duration_s == pytest.approx(bupt1.ENERGY_SEGMENT_S + (552.95 - 500) * 60, abs=1)
