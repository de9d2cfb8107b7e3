"""Replay of the shipped recorded run passes on this build, on this machine, even with the
payload's start delayed by twice its measured boot; a build with a deliberate change in behaviour
fails it. (Finding 11: the recording's cuts, played at its wall instants, landed before the tasks
could finish wherever the payload boots slower than where it was recorded.)"""

import os
import shutil
from pathlib import Path

import pytest

from hil.replay import replay

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "hil" / "replays" / "demo-2tasks.jsonl"


@pytest.mark.slow
def test_shipped_log_replays_identically(model_dirs, tmp_path):
    report = replay(str(LOG), str(tmp_path / "replay"), model=model_dirs["qwen3-vl"], say=lambda s: None)
    assert report.commands_sent >= 10
    assert report.passed, report.differences


@pytest.mark.slow
def test_a_slower_boot_than_the_recordings_still_replays_identically(model_dirs, tmp_path):
    from hil.testbench import measure_boot_seconds

    delay = 2 * measure_boot_seconds()
    report = replay(
        str(LOG),
        str(tmp_path / "replay"),
        model=model_dirs["qwen3-vl"],
        say=lambda s: None,
        payload_start_delay_s=delay,
    )
    assert report.passed, report.differences
    assert any("clock held" in n for n in report.notes)


@pytest.mark.slow
def test_a_changed_build_diverges(model_dirs, tmp_path, monkeypatch):
    """The same replay against a build whose greedy decoding takes the second-best token."""
    build = tmp_path / "build"
    shutil.copytree(ROOT / "flight", build / "flight", ignore=shutil.ignore_patterns("__pycache__"))
    engine = build / "flight" / "engine" / "decode.py"
    text = engine.read_text()
    changed = text.replace("tokens.append(int(logits.argmax(-1)))", "tokens.append(int(logits.topk(2).indices[0, 1]))")
    assert changed != text
    engine.write_text(changed)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(build), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(tmp_path)  # `python -m` puts the working directory first on sys.path
    report = replay(str(LOG), str(tmp_path / "replay"), model=model_dirs["qwen3-vl"], say=lambda s: None)
    assert not report.passed
    assert any("token_ids" in d for d in report.differences), report.differences
