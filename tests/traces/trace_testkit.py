"""Helpers shared by the trace tests (importable: pytest puts each test folder on sys.path)."""

from __future__ import annotations

import argparse
from pathlib import Path

# The 12-second example of docs/trace-format.md section 5, kept here independently so that the
# broken-trace table does not change when the documentation is edited.
EXAMPLE_LINES = [
    '{"format":"orbitweaver-trace","version":1,"name":"example","description":"Two short windows.",'
    '"duration_s":12,"telemetry_period_s":1,"reference_request_s":10,"time_scale":1,'
    '"source":{"kind":"manual"},"assumptions":[]}',
    '{"type":"power_on","t":0}',
    "[0,16.2,0.95,45,15]",
    "[1,16.2,0.95,47.2,15]",
    "[2,16.2,0.95,49.1,15]",
    '{"type":"warning","t":3,"cause":"thermal","lead_s":2}',
    "[3,16.2,0.95,51,15]",
    "[4,16.2,0.95,53,15]",
    '{"type":"cut","t":5,"cause":"thermal","lead_s":2}',
    "[5,16.21,0.95,55,0]",
    "[6,16.21,0.95,52.1,0]",
    "[7,16.21,0.95,49.5,0]",
    '{"type":"power_on","t":8}',
    "[8,16.2,0.95,47,15]",
    "[9,16.2,0.95,48.8,15]",
    "[10,16.2,0.95,50.5,15]",
    '{"type":"cut","t":11,"cause":"fdir","lead_s":0}',
    "[11,16.21,0.95,52.1,0]",
    "[12,16.21,0.95,49.6,0]",
]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def run(argv: list[str]) -> int:
    """A trace command as `ow hil` registers it; returns its exit status (user errors raise CliError)."""
    from traces.cli import register_trace_commands

    parser = argparse.ArgumentParser(prog="ow hil")
    sub = parser.add_subparsers(dest="command", required=True)
    register_trace_commands(sub)
    args = parser.parse_args(argv)
    return args.func(args)
