"""The traces shipped in traces/data/: valid, small, regenerable byte for byte, and each shaped
the way its documentation says."""

from __future__ import annotations

import pytest

from traces import SHIPPED_NAMES, load, shipped_path, validate
from traces.catalog import GENERATED_NAMES, HAND_WRITTEN_NAMES
from traces.format import dumps
from traces.presets import PRESETS, generate

MIB = 1024 * 1024


@pytest.mark.parametrize("name", [n for n in SHIPPED_NAMES if n not in HAND_WRITTEN_NAMES])
def test_shipped_trace_is_valid_small_and_documented(name: str):
    path = shipped_path(name)
    assert validate(path) == []
    assert path.stat().st_size < MIB
    trace = load(path)
    assert trace.name == name
    assert trace.telemetry_period_s == 1.0 and trace.time_scale == 1.0
    assert trace.reference_request_s == 180.0
    assert trace.duration_s <= 5 * 3600  # a few hours at most; longer runs are generated
    assert len(trace.assumptions) >= 5 and trace.description
    assert trace.source["kind"] in ("generator", "import")


@pytest.mark.parametrize("name", GENERATED_NAMES)
def test_regeneration_reproduces_the_shipped_file(name: str):
    assert dumps(generate(name)) == shipped_path(name).read_text(encoding="utf-8")


def test_sat1_like_is_thermal_bound_with_warnings():
    s = load("sat1-like").stats()
    assert s.cuts_by_cause["thermal"] >= 0.9 * s.cuts and s.cuts_by_cause["power"] == 0
    assert s.warned_cuts == s.cuts_by_cause["thermal"] and s.warning_lead_mean_s == 10.0
    assert 40 <= s.window_median_s <= 60  # the reported 48 s heating


def test_sat2_like_is_power_bound_with_warnings():
    s = load("sat2-like").stats()
    assert s.cuts_by_cause["power"] > s.cuts / 2 and s.cuts_by_cause["thermal"] == 0
    assert s.warned_cuts == s.cuts_by_cause["power"] and s.warning_lead_mean_s == 60.0
    assert s.window_median_s > 180  # windows span several requests


def test_dellingr_like_is_fdir_bound_without_warnings():
    trace = load("dellingr-like")
    s = trace.stats()
    assert s.cuts == s.cuts_by_cause["fdir"] >= 20 and s.warned_cuts == 0
    expected = PRESETS["dellingr-like"].fdir.rate_per_s * s.on_time_s
    assert abs(s.cuts - expected) <= 4 * expected**0.5


def test_trace_a_windows_are_all_shorter_than_a_request():
    s = load("trace-a").stats()
    assert s.windows_shorter_than_request == s.windows >= 50
    assert s.window_max_s < s.reference_request_s / 2
    assert s.warned_cuts == 0
    assert s.cuts_by_cause["fdir"] > 0 and s.cuts_by_cause["thermal"] > 0


def test_trace_b_mixes_all_four_causes():
    s = load("trace-b").stats()
    assert all(count > 0 for count in s.cuts_by_cause.values()), dict(s.cuts_by_cause)
    assert s.window_min_s < s.reference_request_s < s.window_max_s
    assert 0 < s.warned_cuts < s.cuts


@pytest.mark.parametrize("name", HAND_WRITTEN_NAMES)
def test_hand_written_trace_is_valid_and_documented(name: str):
    path = shipped_path(name)
    assert validate(path) == []
    trace = load(path)
    assert trace.name == name and trace.description and trace.assumptions
    assert trace.source["kind"] == "manual"
    assert set(trace.stats().cuts_by_cause) >= {"thermal", "fdir", "power", "contention"}
