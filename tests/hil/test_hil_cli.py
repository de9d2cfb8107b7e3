"""`ow hil run` on bad input: one line, its exit status, nothing written (issue 27, finding 8: a
truncated model was the safetensors library's traceback)."""

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


def test_run_with_a_truncated_model_is_one_line(tmp_path, capsys, model_dirs):
    model = Path(shutil.copytree(model_dirs["qwen3-vl"], tmp_path / "model"))
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    out = tmp_path / "out"
    code = main(["hil", "run", "--trace", "trace-a", "--model", str(model), "--requests", "1", "--out", str(out)])
    _one_line(capsys, 3, code, "is truncated")
    assert not out.exists()
