"""The boot-failure record: the one line a payload prints when it exits before it could come up,
and how the bus reads it back (docs/bus.md §6, docs/flight.md "Boot").

The payload writes, as its last line on stderr before it exits,

    {"boot_failed": "<why, one line>", "exit_status": <the status it exits with>}

The bus's local and ssh drivers keep the payload's output (`payload.log` in the bus's data
directory; an ssh session carries the remote stderr), so the bus finds the record in what that
boot wrote and names it in its boot-loop event. Where there is no record (a process killed by a
signal, a board behind a relay) the bus says what it saw instead: the exit status, the signal, or
that the payload never connected. A line rather than a file in the payload's data directory: it
travels the same way for every driver that carries output, and it needs no writable disk.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

KEY = "boot_failed"
#: Reasons are cut to this many characters: the bus puts them into a 512-byte event text.
MAX_REASON_CHARS = 300
#: How much of a boot's output the bus reads back, from its end, to find the record.
TAIL_BYTES = 64 * 1024


def line(reason: str, exit_status: int) -> str:
    """The record as one line of JSON (no newline)."""
    reason = " ".join(str(reason).split())  # one line, whatever the message held
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    return json.dumps({KEY: reason, "exit_status": int(exit_status)}, ensure_ascii=True)


def write(reason: str, exit_status: int, stream: TextIO | None = None) -> None:
    """Print the record (to stderr by default). Never raises: it is written on the way out of a
    process that is already failing (possibly for want of memory)."""
    try:
        print(line(reason, exit_status), file=stream or sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - the exit status still tells the bus something
        pass


def find(text: str) -> tuple[str, int | None] | None:
    """The last record in `text` (a boot's output), as (reason, exit status), or None."""
    for raw in reversed(text.splitlines()):
        candidate = raw.strip()
        if not candidate.startswith('{"' + KEY + '"'):
            continue
        try:
            record = json.loads(candidate)
        except ValueError:
            continue  # a line torn by a kill, or something else that looks alike
        reason = record.get(KEY) if isinstance(record, dict) else None
        if isinstance(reason, str) and reason:
            status = record.get("exit_status")
            return reason[:MAX_REASON_CHARS], status if isinstance(status, int) else None
    return None
