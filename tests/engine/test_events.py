"""The engine's events are the members of flight.events.EngineEvent, named as such wherever they
are reported or matched: a string typed by hand (a misspelt one was dropped in silence) fails
here, naming the file and line. Parsed with `ast`; nothing is run."""

from __future__ import annotations

import ast
from pathlib import Path

from flight.events import UNIT_DONE, EngineEvent, no_events

ROOT = Path(__file__).resolve().parents[2]
VALUES = {member.value for member in EngineEvent}


def _sources():
    for package in ("flight", "hil", "bench", "ground", "common"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path != ROOT / "flight" / "events.py":
                yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_events_are_reported_and_matched_by_member():
    """No string in the product spells an engine event: each is reported, matched, listed or
    looked up by its member."""
    found = []
    for path, tree in _sources():
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in VALUES:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert not found, "engine events named by a string instead of EngineEvent:\n  " + "\n  ".join(found)


def test_the_members_read_as_the_strings_the_logs_carry():
    """Logs, tests and tools written against the names keep reading them."""
    assert EngineEvent.PREFILL_BLOCK_DONE == "prefill_block_done"
    assert f"{EngineEvent.REQUEST_OPENED}" == "request_opened"
    assert UNIT_DONE == {"vision_block_done", "prefill_block_done", "decode_step_done"}
    assert no_events(EngineEvent.REQUEST_COMPLETED, tokens=1) is None
