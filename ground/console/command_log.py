"""Reading the station's command log (`<state>/commands.jsonl`, docs/ground.md "Command log"):
what it holds, the rotated file first, then each line appended later, across rotations. The
console's command history and `ow ground commands` both read it through `CommandLogReader`.

Writers (ground/state.py `log_command`) append whole lines with one write() on an O_APPEND file
and rename the file to `.jsonl.1` past 16 MiB; a writer killed mid-line leaves a torn line, and
the next writer starts a line of its own after it. So a reader takes complete lines only, holds
back a line still being written, and counts (and skips) a line that is not a command entry.
"""

from __future__ import annotations

import calendar
import os
import re
import time
from pathlib import Path
from typing import BinaryIO

from common.wire.text import display_text
from ground.state import parse_command_line


class CommandLogReader:
    """Incremental reader of one station's command log. `damaged` counts the lines skipped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.rotated = self.path.with_suffix(".jsonl.1")
        self.damaged = 0
        self._file: BinaryIO | None = None
        self._partial = b""

    def backlog(self) -> list[dict]:
        """Everything logged so far, oldest first: the rotated file, then the current one (whose
        position is kept, so `new()` goes on from its end)."""
        entries: list[dict] = []
        try:
            with open(self.rotated, "rb") as rotated:
                entries += self._parse(rotated.read().split(b"\n"))
        except FileNotFoundError:
            pass
        return entries + self.new()

    def new(self) -> list[dict]:
        """The complete lines appended since the last call. After a rotation, the old file is read
        to its end and then the new one from its start."""
        entries: list[dict] = []
        while True:
            if self._file is None:
                try:
                    self._file = open(self.path, "rb")  # noqa: SIM115 - held open between calls
                except FileNotFoundError:
                    return entries
            data = self._file.read()
            if data:
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()  # a line still being written
                entries += self._parse(lines)
            try:
                moved = os.stat(self.path).st_ino != os.fstat(self._file.fileno()).st_ino
            except FileNotFoundError:
                moved = True
            if not moved:
                return entries
            self._file.close()  # rotated: read to its end above; on to the new file
            self._file, self._partial = None, b""
            if not self.path.exists():
                return entries

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _parse(self, lines: list[bytes]) -> list[dict]:
        entries = []
        for line in lines:
            if not line.strip():
                continue
            entry = parse_command_line(line)
            if entry is None:
                self.damaged += 1
            else:
                entries.append(entry)
        return entries


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_AGE_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_UTC = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?:[T ](\d{2}):(\d{2})(?::(\d{2})(\.\d+)?)?)?(Z|\+00:?00)?$")


def parse_since(text: str, now: float | None = None) -> float:
    """`--since`: a UTC time (`2026-12-05`, `2026-12-05T11:30`, `2026-12-05T11:30:00Z`,
    `2026-12-05 11:30:00.5`) or an age before now (`90s`, `15m`, `2h`, `1d`, `1.5h`), as Unix
    time. ValueError with a one-line reason otherwise."""
    age = _AGE.match(text)
    if age:
        return (time.time() if now is None else now) - float(age.group(1)) * _AGE_SECONDS[age.group(2)]
    found = _UTC.match(text.strip())
    if found:
        year, month, day, hour, minute, second, fraction, _ = found.groups()
        stamp = f"{year}-{month}-{day} {hour or '00'}:{minute or '00'}:{second or '00'}"
        try:
            parsed = time.strptime(stamp, "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise ValueError(f"{text!r} is not a valid date and time") from None
        return calendar.timegm(parsed) + (float(fraction) if fraction else 0.0)
    raise ValueError(
        f"{text!r} is neither a UTC time (2026-12-05, 2026-12-05T11:30:00Z) nor an age before now (90s, 15m, 2h, 1d)"
    )


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(round(t * 1000)) % 1000:03d}Z"


def command_line(entry: dict) -> str:
    """One entry as `ow ground commands` prints it: time, command and what it named, round trip,
    who sent it, the answer; hidden characters escaped (docs/ground.md "What is printed")."""
    command = str(entry.get("command", ""))
    what = str(entry.get("what") or "")
    named = f"{command} {what}" if what and not what.startswith(command) else (what or command)
    if entry.get("chunks") is not None:
        named += f" x{entry['chunks']}"
    elif isinstance(entry.get("sends"), int) and entry["sends"] > 1:
        named += f" (sent {entry['sends']} x)"
    code = str(entry.get("code", "?"))
    answer = code
    if entry.get("by") and code not in ("OK", "NO_ANSWER"):
        answer += f" (by {entry['by']}{', not yet' if entry.get('not_yet') else ''})"
    if entry.get("text"):
        answer += f": {entry['text']}"
    t = entry.get("t")
    when = _utc(float(t)) if isinstance(t, int | float) else "-" * 24
    rtt = entry.get("rtt_ms")
    rtt_text = f"{float(rtt):.1f} ms" if isinstance(rtt, int | float) else "-"
    origin = str(entry.get("origin") or "?")
    return display_text(f"{when}  {named:<40} {rtt_text:>10}  {origin:<20} {answer}")
