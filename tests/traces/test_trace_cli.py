"""Trace commands as registered into an argparse tree (as `ow hil` does) and via `python -m traces`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trace_testkit import run, write_lines

from common.cli import CliError
from traces import load
from traces.format import dumps
from traces.presets import generate

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["sat1-like", "sat2-like", "dellingr-like", "trace-a", "trace-b", "bupt1"])
def test_trace_info_prints_the_statistics(name: str, capsys):
    assert run(["trace-info", name]) == 0
    out = capsys.readouterr().out
    s = load(name).stats()
    assert f"windows      {s.windows}" in out
    assert (
        f"cuts         {s.cuts}: power {s.cuts_by_cause['power']}, thermal {s.cuts_by_cause['thermal']}, "
        f"fdir {s.cuts_by_cause['fdir']}, contention {s.cuts_by_cause['contention']}" in out
    )
    assert f"mean {round(s.window_mean_s, 1):g} s" in out
    assert f"duty cycle   {100 * s.duty_cycle:.1f} %" in out
    assert f"warning      {s.warned_cuts} of {s.cuts} cuts warned" in out


def test_trace_info_json(capsys):
    assert run(["trace-info", "trace-a", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"] == "trace-a" and data["windows"] == load("trace-a").stats().windows


def test_trace_info_on_a_path_and_on_errors(tmp_path: Path, example_lines, capsys):
    path = write_lines(tmp_path / "ok.jsonl", example_lines)
    assert run(["trace-info", str(path)]) == 0
    assert "cuts         2: power 0, thermal 1, fdir 1, contention 0" in capsys.readouterr().out
    with pytest.raises(CliError) as missing:
        run(["trace-info", "no-such-trace"])
    assert missing.value.code == 2 and "not a shipped trace name" in str(missing.value)
    broken = write_lines(tmp_path / "broken.jsonl", example_lines[:-1] + ["[12,16.21,3,49.6,0]"])
    with pytest.raises(CliError) as invalid:
        run(["trace-info", str(broken)])
    assert invalid.value.code == 1 and str(invalid.value).startswith(f"{broken}:19: ")


def test_trace_validate_reports_file_and_line(tmp_path: Path, example_lines, capsys):
    good = write_lines(tmp_path / "good.jsonl", example_lines)
    bad = write_lines(tmp_path / "bad.jsonl", example_lines[:5] + example_lines[6:])  # drop the warning
    assert run(["trace-validate", str(good), "trace-a"]) == 0
    assert run(["trace-validate", str(good), str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{good}: ok" in out
    assert any(line.startswith(f"{bad}:8: cut at t=5 has lead_s=2 but no warning") for line in out)


def test_trace_generate_writes_the_generator_output(tmp_path: Path):
    out = tmp_path / "b.jsonl"
    assert run(["trace-generate", "--kind", "trace-b", "--seed", "9", "--duration", "1200", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == dumps(generate("trace-b", seed=9, duration_s=1200))
    with pytest.raises(SystemExit):
        run(["trace-generate", "--kind", "sat9", "--out", str(out)])
    with pytest.raises(CliError):
        run(["trace-generate", "--kind", "trace-a", "--duration", "0", "--out", str(out)])
    with pytest.raises(CliError, match="31 days"):  # would simulate for hours and hold it all in memory
        run(["trace-generate", "--kind", "trace-a", "--duration", str(10**12), "--out", str(out)])


def test_trace_import_bupt1_reports_missing_data(tmp_path: Path):
    with pytest.raises(CliError) as caught:
        run(["trace-import-bupt1", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "x.jsonl")])
    assert caught.value.code == 1 and "data folder not found" in str(caught.value)
    with pytest.raises(CliError) as nan:  # was a ValueError traceback (issue 27, finding 8)
        run(["trace-import-bupt1", "--overheat-from-min", "nan", "--out", str(tmp_path / "x.jsonl")])
    assert nan.value.code == 2 and "--overheat-from-min" in str(nan.value)


def test_python_dash_m_traces():
    done = subprocess.run(
        [sys.executable, "-m", "traces", "trace-info", "trace-a"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "cuts         " in done.stdout
    failed = subprocess.run(
        [sys.executable, "-m", "traces", "trace-info", "nope"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert failed.returncode == 2
    assert failed.stderr.count("\n") == 1 and "error: nope: no such trace file" in failed.stderr


def test_trace_info_without_a_trace_lists_the_shipped_ones(capsys):
    # `ow hil run --help` sends the user here to find a trace name
    assert run(["trace-info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["TRACE", "DURATION", "WINDOWS", "CUTS"]
    from traces.catalog import SHIPPED_NAMES

    rows = {line.split()[0]: line for line in lines[1:] if line.split()[0] in SHIPPED_NAMES}
    assert set(rows) == set(SHIPPED_NAMES)
    demo = load("demo").stats()
    assert rows["demo"].split()[1:4] == ["300", "s", str(demo.windows)]
    assert rows["trace-a"].split()[1:4] == [f"{load('trace-a').stats().duration_s / 3600:.2f}", "h", "103"]
    assert run(["trace-info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["trace"] for d in data] == list(SHIPPED_NAMES) and data[-1]["windows"] == demo.windows
