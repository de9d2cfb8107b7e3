"""`ow hil run | campaign | deploy` on bad values: one line, its exit status, nothing written
(issue 27, finding 8: `--time-scale -1` and `--pace-ms -1` reached the bus, which refused them, and
came back as a RuntimeError traceback; a truncated model was the safetensors library's traceback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import structlog

from common.cli import main


@pytest.fixture(autouse=True)
def _reset_logging():
    yield
    structlog.reset_defaults()  # the commands point structlog at the captured stderr


def _one_line(capsys, code: int, returned: int, fragment: str) -> None:
    err = capsys.readouterr().err
    assert returned == code, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ow hil: error: ") and fragment in lines[0], err


RUN_CASES = [
    (["--time-scale", "-1"], "--time-scale must be a finite number > 0"),
    (["--time-scale", "nan"], "--time-scale"),
    (["--time-scale", "inf"], "--time-scale"),
    (["--pace-ms", "-1"], "--pace-ms must be a finite number >= 0"),
    (["--pace-ms", "nan"], "--pace-ms"),
    (["--request-seconds", "0"], "--request-seconds"),
    (["--start-at", "-5"], "--start-at"),
    (["--start-at", "1e9"], "not before the end of trace trace-a"),
    (["--timeout", "nan"], "--timeout"),
    (["--boot-trace-s", "inf"], "--boot-trace-s"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--chunk", "0"], "--chunk"),
    (["--planner", "fastest"], "unknown --planner"),
]


def test_run_and_campaign_refuse_bad_numbers_before_anything_is_written(tmp_path, capsys, model_dirs):
    out = tmp_path / "out"
    base = ["--model", model_dirs["qwen3-vl"], "--requests", "1", "--out", str(out)]
    for args, fragment in RUN_CASES:
        _one_line(capsys, 2, main(["hil", "run", "--trace", "trace-a", *base, *args]), fragment)
    for args, fragment in RUN_CASES[:4]:
        _one_line(capsys, 2, main(["hil", "campaign", "--traces", "trace-a", *base, *args]), fragment)
    deploy = ["hil", "deploy", "--model", model_dirs["qwen3-vl"], "--out", str(out)]
    for args, fragment in (
        (["--hours", "nan"], "--hours"),
        (["--hours", "inf"], "--hours"),
        (["--scale", "-1"], "--scale"),
    ):
        _one_line(capsys, 2, main([*deploy, *args]), fragment)
    assert not out.exists()
    # an --out that is a file: was a FileExistsError or NotADirectoryError traceback
    a_file = tmp_path / "a-file"
    a_file.write_text("kept\n")
    on_file = ["--model", model_dirs["qwen3-vl"], "--requests", "1", "--out", str(a_file)]
    _one_line(capsys, 2, main(["hil", "run", "--trace", "trace-a", *on_file]), "is a regular file")
    _one_line(capsys, 2, main(["hil", "campaign", "--traces", "trace-a", *on_file]), "is a regular file")
    _one_line(
        capsys, 2, main(["hil", "deploy", "--model", model_dirs["qwen3-vl"], "--out", str(a_file)]), "is a regular file"
    )
    assert a_file.read_text() == "kept\n"


def test_run_with_a_truncated_model_is_one_line(tmp_path, capsys, model_dirs):
    model = Path(shutil.copytree(model_dirs["qwen3-vl"], tmp_path / "model"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    out = tmp_path / "out"
    code = main(["hil", "run", "--trace", "trace-a", "--model", str(model), "--requests", "1", "--out", str(out)])
    _one_line(capsys, 3, code, "is truncated")
    assert not out.exists()


def test_replay_of_a_file_that_is_not_a_bus_log_is_one_line(tmp_path, capsys):
    """Checked as a demanding user would beside finding 8: a JSON line that is not a bus log entry
    was a KeyError traceback."""
    for name, content in (("random", bytes(range(256)) * 8), ("json", b'{"x": 1}\n'), ("list", b"[1, 2]\n")):
        log = tmp_path / f"{name}.jsonl"
        log.write_bytes(content)
        code = main(["hil", "replay", str(log), "--out", str(tmp_path / "out")])
        _one_line(capsys, 2, code, f"{log}:1: not a")
    assert not (tmp_path / "out").exists()
