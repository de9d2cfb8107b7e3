"""Checkpoint cadence: when to write a record beyond what the policy's fixed cadence asks.

The paper fixes the cadence: a decode record every D steps, a vision state every k blocks. That
is right when a window is long against D steps; in a short window the boot and the recovery
leave fewer than D decode steps, and a decode phase that only ever writes every D steps makes no
durable progress at all. The payload knows more than the cadence uses:

* a **shutdown warning** from the bus says when the cut comes;
* the bus's **telemetry** (payload temperature, battery state of charge) shows the trend towards
  the thermal limit or the brown-out threshold that will end the window;
* the **windows it has lived through** since launch (persisted, `WindowLog`) give the
  distribution of window lengths, hence the chance that this window ends within the next
  seconds given how long it has lasted.

`Cadence("adaptive")` turns these into p, the probability that power goes before the next record
the fixed cadence would write, and writes a record at this unit boundary when p is at least
`P_MIN`, the work it saves in expectation (p x the work since the last record) is worth the time
a record of that kind takes to write (measured, and kept across boots in `state/write-costs`:
`WriteCosts`, with the vision states' write rate), and that write ends before the next scheduled
record is due (so it never holds that one back in the writer's queue). The fixed cadence stays
an upper bound on the spacing of decode records: adaptive only adds those. Of the vision states
it schedules, adaptive skips one whose write, behind the writer's backlog, would outlast both
the vision phase and the work the state saves, unless a cut is likely before vision.out is
durable (`skip_vision_state`). Records written early hold exactly what the fixed ones hold
(decode records cover every step since the last durable one), and a skipped state only removes
one that a later record supersedes, so the answer is bitwise the same. It also picks a new
task's prefill block shape: the layers per block (G) such that one block is short against the
windows lived through (`prefill_group`), chosen once per task and kept in its MANIFEST.
`Cadence("fixed")` is the paper's cadence (docs/engine.md).

All times are the payload's own seconds (a warning's lead and the bus clock in telemetry run at
the payload's wall speed, docs/bus.md §1), so nothing here knows about compressed time.
"""

from __future__ import annotations

import bisect
import math
import os
import statistics
import struct
import threading
import time
from collections import deque

import crc32c

CADENCES = ("fixed", "adaptive")
#: least probability of a cut before the next scheduled record that makes an early record worth it
P_MIN = 0.2
#: windows of history used (the most recent): enough for a distribution, recent enough to follow
#: a change of regime (season, attitude, another FDIR rate)
HISTORY_WINDOWS = 256
#: history windows needed before the empirical distribution is trusted
MIN_WINDOWS = 3
#: telemetry samples the trend is fitted over
TREND_SAMPLES = 12
#: the most of the typical window (the median of those lived through) one adaptive prefill block
#: may take: a cut at a random instant loses the block in progress, about half a block on average,
#: so a block of a quarter window loses an eighth of the window's work, not half of it
BLOCK_WINDOW_SHARE = 0.25
#: defaults of the limits that end windows (the payload's interface to its bus): the paper's Sat-1
#: enclosure limit (55 C, Sec. 2.2) and the brown-out threshold of the shipped power-bound traces
DEFAULT_THERMAL_LIMIT_C = 55.0
DEFAULT_SOC_CUTOFF = 0.40

_ENTRY = struct.Struct("<IdI")  # boot count, seconds, crc32c of the first 12 bytes
#: the phases whose record writes are timed for early records, in `state/write-costs` order
COST_PHASES = ("vision", "decode")
#: the key of the vision states' write rate (seconds per MiB) among the costs kept in
#: `state/write-costs` (`Cadence.learned_writes`, `WriteCosts`), after the phases' times
VISION_RATE_KEY = "vision_per_mib"
_MIB = float(1 << 20)
#: the layout before the rate was kept: seconds per vision state, per decode record, crc32c of the first 16 bytes
_COSTS_V1 = struct.Struct("<ddI")
#: seconds per vision state, per decode record, seconds per MiB of a vision state, crc32c of the first 24 bytes
_COSTS = struct.Struct("<dddI")
#: vision-state writes whose seconds per byte the rate is the median of (docs/engine.md, "Cadence"):
#: up to two burst-assisted or stalled writes among five leave the median on the sustained rate
RATE_WINDOW = 5
#: how many of RATE_WINDOW the rate kept from earlier boots counts as at a boot: one write of the
#: new process cannot move the median, three that agree outvote it
PRIOR_WRITES = 2


def _seal(head: bytes) -> bytes:
    """`head` followed by its CRC32C (the layout of every entry under state/)."""
    return head + struct.pack("<I", crc32c.crc32c(head))


def _unseal(raw: bytes, entry: struct.Struct) -> tuple | None:
    """The fields of a sealed `entry` without its CRC, or None if torn or damaged."""
    if len(raw) != entry.size:
        return None
    *fields, crc = entry.unpack(raw)
    return tuple(fields) if crc == crc32c.crc32c(raw[:-4]) else None


def _pack(boot: int, seconds: float) -> bytes:
    return _seal(struct.pack("<Id", boot & 0xFFFFFFFF, seconds))


def _unpack(raw: bytes) -> tuple[int, float] | None:
    fields = _unseal(raw, _ENTRY)
    if fields is None or not math.isfinite(fields[1]) or fields[1] < 0:
        return None
    return fields[0], fields[1]


class WindowLog:
    """The power windows this payload has lived through, on disk (docs/engine.md, "Cadence").

    `state/alive` holds one entry, rewritten in place and synced every `period_s` while the
    process runs: (boot, seconds since the process started). At the next start that entry is
    the length of the window that ended (to within one period) and is appended to
    `state/windows.log` (16-byte entries with their own CRC32C; a damaged entry is skipped and
    counted, never a reason to drop the ones behind it)."""

    def __init__(self, state_dir: str, clock=time.monotonic, started: float | None = None):
        self.dir = state_dir
        os.makedirs(state_dir, exist_ok=True)
        self.alive_path = os.path.join(state_dir, "alive")
        self.log_path = os.path.join(state_dir, "windows.log")
        self.clock = clock
        self.started = clock() if started is None else started
        self.boot = 0
        self.bytes_dropped = 0
        self.lengths: list[float] = []
        self._fd: int | None = None

    def open(self, boot: int) -> list[float]:
        """Log the window the previous process lived through; start this one's marker. Returns
        the window lengths (oldest first, at most HISTORY_WINDOWS)."""
        self.boot = boot
        entries = self._read_log()
        previous = None
        try:
            with open(self.alive_path, "rb") as f:
                previous = _unpack(f.read(_ENTRY.size))
        except OSError:
            pass
        if previous is not None and previous[0] != boot and (not entries or entries[-1][0] != previous[0]):
            self._append(previous)
            entries.append(previous)
        if len(entries) > 16 * HISTORY_WINDOWS:
            self._compact(entries[-HISTORY_WINDOWS:])
        self.lengths = [seconds for _, seconds in entries[-HISTORY_WINDOWS:]]
        self._fd = os.open(self.alive_path, os.O_RDWR | os.O_CREAT, 0o644)
        self.mark()
        return list(self.lengths)

    def _read_log(self) -> list[tuple[int, float]]:
        try:
            with open(self.log_path, "rb") as f:
                raw = f.read()
        except OSError:
            return []
        entries = []
        whole = len(raw) - len(raw) % _ENTRY.size
        for offset in range(0, whole, _ENTRY.size):
            entry = _unpack(raw[offset : offset + _ENTRY.size])
            if entry is None:
                self.bytes_dropped += _ENTRY.size
            else:
                entries.append(entry)
        self.bytes_dropped += len(raw) - whole  # a torn last entry
        return entries

    def _append(self, entry: tuple[int, float]) -> None:
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size % _ENTRY.size:  # a torn entry at the end: realign so the next ones parse
                os.ftruncate(fd, size - size % _ENTRY.size)
            os.write(fd, _pack(*entry))
            os.fsync(fd)
        finally:
            os.close(fd)

    def _compact(self, keep: list[tuple[int, float]]) -> None:
        tmp = self.log_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(b"".join(_pack(*e) for e in keep))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.log_path)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def uptime(self) -> float:
        return self.clock() - self.started

    def mark(self) -> None:
        """Make `uptime()` durable as this window's length so far."""
        if self._fd is not None:
            os.pwrite(self._fd, _pack(self.boot, self.uptime()), 0)
            os.fdatasync(self._fd)

    def period_s(self) -> float:
        """How often to mark: a twentieth of the median window (lengths known to ~5 %, enough
        for a distribution), between 0.1 s and 2 s: on a Jetson with 30 s windows, one 4 KiB
        page every 1.5 s."""
        if len(self.lengths) < MIN_WINDOWS:
            return 0.25
        return min(2.0, max(0.1, _median(self.lengths) / 20.0))

    def keep_marking(self, stop: threading.Event, also=None) -> None:
        """Thread body: mark until `stop` is set (or power goes); `also()` after each mark (the
        cadence's write costs, kept by the same thread)."""
        while not stop.wait(self.period_s()):
            try:
                self.mark()
            except OSError:
                return  # a full or failing disk must not take the payload with it
            if also is not None:
                try:
                    also()
                except OSError:
                    also = None  # nor take the window log with it

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class WriteCosts:
    """What a record of each phase took to write, and the vision states' write rate, on disk
    (docs/engine.md, "Cadence"): `state/write-costs`, so that a payload that boots into a short
    window knows its storage before it has timed a write in this window. One 28-byte entry
    rewritten in place (a torn write fails its CRC and is ignored: the next measurement rewrites
    it); the 20-byte entry written before the rate was kept still reads, without a rate."""

    def __init__(self, state_dir: str):
        os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, "write-costs")
        self.damaged = False  # the file was there but not a valid entry
        self._saved: dict[str, float] = {}
        self._fd: int | None = None

    def load(self) -> dict[str, float]:
        try:
            with open(self.path, "rb") as f:
                raw = f.read(_COSTS.size + 1)  # one byte more: a longer file is damaged
        except FileNotFoundError:
            return {}
        costs = self._unpack(raw)
        if costs is None:
            self.damaged = True
            return {}
        self._saved = dict(costs)
        return costs

    @staticmethod
    def _unpack(raw: bytes) -> dict[str, float] | None:
        if len(raw) == _COSTS_V1.size:  # written before the rate was kept
            values = _unseal(raw, _COSTS_V1)
        else:
            values = _unseal(raw, _COSTS)
        if values is None:
            return None
        costs = {}
        for key, value in zip(_COST_KEYS, values, strict=False):
            if math.isnan(value):
                continue
            if not math.isfinite(value) or value < 0:
                return None
            costs[key] = value
        return costs

    def save(self, costs: dict[str, float]) -> None:
        """Make `costs` durable if they differ from what is on disk."""
        known = {key: costs[key] for key in _COST_KEYS if key in costs}
        if known == self._saved:
            return
        head = struct.pack("<ddd", *(known.get(key, math.nan) for key in _COST_KEYS))
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(self._fd, _COSTS.size)  # a damaged file may have been longer, an older one shorter
        os.pwrite(self._fd, _seal(head), 0)
        os.fdatasync(self._fd)
        self._saved = known

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: what `state/write-costs` holds, in its order
_COST_KEYS = (*COST_PHASES, VISION_RATE_KEY)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


class _Trend:
    """Least-squares slope of the last TREND_SAMPLES (time, value) samples."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=TREND_SAMPLES)

    def add(self, t: float, value: float) -> None:
        if self.samples and t <= self.samples[-1][0]:
            if t < self.samples[-1][0] - 1.0:  # the bus clock went back (a restarted bus): start over
                self.samples.clear()
            else:
                return
        self.samples.append((t, value))

    def time_to(self, limit: float, rising: bool) -> float:
        """Seconds until the fitted line reaches `limit` from the newest sample (inf if it never
        does, or with fewer than 3 samples)."""
        if len(self.samples) < 3:
            return math.inf
        ts = [t for t, _ in self.samples]
        vs = [v for _, v in self.samples]
        tm, vm = sum(ts) / len(ts), sum(vs) / len(vs)
        var = sum((t - tm) ** 2 for t in ts)
        if var <= 0:
            return math.inf
        slope = sum((t - tm) * (v - vm) for t, v in zip(ts, vs, strict=True)) / var
        now_value = vm + slope * (ts[-1] - tm)
        gap = (limit - now_value) if rising else (now_value - limit)
        rate = slope if rising else -slope
        if gap <= 0:
            return 0.0
        return gap / rate if rate > 0 else math.inf


class Cadence:
    """Decides early records. Thread-safe: the link thread feeds warnings and telemetry, the
    engine thread asks. One per payload process, shared by the tasks it runs."""

    def __init__(
        self,
        mode: str = "fixed",
        windows: list[float] | None = None,
        *,
        clock=time.monotonic,
        started: float | None = None,
        thermal_limit_c: float = DEFAULT_THERMAL_LIMIT_C,
        soc_cutoff: float = DEFAULT_SOC_CUTOFF,
        write_s: dict[str, float] | None = None,
    ):
        if mode not in CADENCES:
            raise ValueError(f"unknown cadence {mode!r}; choose from {', '.join(CADENCES)}")
        self.mode = mode
        self.clock = clock
        self.started = clock() if started is None else started
        self.windows = sorted(windows or [])
        self.thermal_limit_c = thermal_limit_c
        self.soc_cutoff = soc_cutoff
        self.cut_at: float | None = None  # when a warned cut comes (payload clock)
        self.temperature = _Trend()
        self.battery = _Trend()
        self.unit_s: dict[str, float] = {}
        self.write_s: dict[str, float] = {}  # measured since launch (WriteCosts)
        # seconds per byte of the last RATE_WINDOW records of each phase (their median is the
        # rate: `write_rate`); the vision states' is kept across boots (WriteCosts)
        self.rate_window: dict[str, deque[float]] = {}
        self.early_records = 0
        self.vision_states_skipped = 0
        self._lock = threading.Lock()
        self.learn_writes(dict(write_s or {}))

    # ---- what the payload learns -----------------------------------------------------------------
    def warning(self, lead_s: float) -> None:
        with self._lock:
            at = self.clock() + max(0.0, lead_s)
            self.cut_at = at if self.cut_at is None else min(self.cut_at, at)

    def thermal(self, bus_clock_s: float, payload_temp_c: float) -> None:
        with self._lock:
            self.temperature.add(bus_clock_s, payload_temp_c)

    def power(self, bus_clock_s: float, battery_soc: float) -> None:
        with self._lock:
            self.battery.add(bus_clock_s, battery_soc)

    def set_windows(self, windows: list[float]) -> None:
        with self._lock:
            self.windows = sorted(windows)

    def observe_unit(self, phase: str, seconds: float) -> None:
        self._observe(self.unit_s, phase, seconds)

    def observe_write(self, phase: str, seconds: float, nbytes: int | None = None) -> None:
        """A record of `phase` took `seconds` to write; `nbytes`, its size, where known, also
        gives the storage's seconds per byte for records of that phase (the median of the last
        RATE_WINDOW: `write_rate`)."""
        self._observe(self.write_s, phase, seconds)
        if nbytes:
            with self._lock:
                window = self.rate_window.setdefault(phase, deque(maxlen=RATE_WINDOW))
                window.append(seconds / nbytes)

    @property
    def write_rate(self) -> dict[str, float]:
        """Seconds per byte of a record of each phase: the median of its last RATE_WINDOW writes
        (with, at a boot, the rate kept from earlier ones as PRIOR_WRITES of them). A median,
        not a decayed mean: a write after an idle spell goes at the storage's burst speed (a
        refilled token bucket, an SSD's cache), one after a stall slower; neither is the rate
        the next large record will see, and up to two of them in five leave the median alone."""
        with self._lock:
            return {phase: statistics.median(window) for phase, window in self.rate_window.items() if window}

    def learn_writes(self, write_s: dict[str, float]) -> None:
        """Start from write times and the vision states' write rate measured before this process
        (WriteCosts); its own measurements override them."""
        with self._lock:
            self.write_s = {**{k: v for k, v in write_s.items() if k in COST_PHASES}, **self.write_s}
            per_mib = write_s.get(VISION_RATE_KEY)
            if per_mib is not None and per_mib > 0 and not self.rate_window.get("vision"):
                self.rate_window["vision"] = deque([per_mib / _MIB] * PRIOR_WRITES, maxlen=RATE_WINDOW)

    def learned_writes(self) -> dict[str, float]:
        """What `state/write-costs` keeps: the write time of each phase's records and the
        vision states' seconds per MiB (VISION_RATE_KEY)."""
        rate = self.write_rate.get("vision")
        with self._lock:
            learned = dict(self.write_s)
        if rate is not None:
            learned[VISION_RATE_KEY] = rate * _MIB
        return learned

    def _observe(self, table: dict, key: str, seconds: float) -> None:
        with self._lock:
            old = table.get(key)
            table[key] = seconds if old is None else 0.7 * old + 0.3 * seconds

    # ---- the estimate ------------------------------------------------------------------------------
    def cut_probability(self, horizon_s: float) -> float:
        """Probability that power goes within `horizon_s` from now."""
        now = self.clock()
        with self._lock:
            if self.cut_at is not None and self.cut_at <= now + horizon_s:
                return 1.0
            if (
                min(
                    self.temperature.time_to(self.thermal_limit_c, rising=True),
                    self.battery.time_to(self.soc_cutoff, rising=False),
                )
                <= horizon_s
            ):
                return 1.0
            return self._history_probability(now - self.started, horizon_s)

    def _history_probability(self, up_s: float, horizon_s: float) -> float:
        n = len(self.windows)
        if n < MIN_WINDOWS:
            return 0.0
        alive = n - bisect.bisect_right(self.windows, up_s)
        if alive >= MIN_WINDOWS:
            survive = n - bisect.bisect_right(self.windows, up_s + horizon_s)
            return 1.0 - survive / alive
        # This window has outlived (nearly) all those seen: no distribution left to condition on,
        # so assume cuts at the mean rate from here on (memoryless).
        return 1.0 - math.exp(-horizon_s / max(1e-9, sum(self.windows) / n))

    # ---- the decision --------------------------------------------------------------------------------
    def early_record(self, phase: str, since: int, every: int) -> bool:
        """Write a record of `phase` now, `since` units after the last one, although the fixed
        cadence would wait until `every`?"""
        if self.mode != "adaptive" or since <= 0 or since >= every:
            return False
        unit, write = self.unit_s.get(phase), self.write_s.get(phase)
        if unit is None or write is None:
            return False  # an unmeasured write could hold the next scheduled record back for any time
        horizon = (every - since) * unit
        if write > horizon:
            return False  # still being written when the next scheduled record is due: it would wait
        p = self.cut_probability(horizon)
        if p < P_MIN or p * since * unit < write:
            return False
        self.early_records += 1
        return True

    def skip_vision_state(
        self,
        since: int,
        blocks_left: int,
        nbytes: int,
        backlog_bytes: int = 0,
        writing_s: float = 0.0,
        writing_bytes: int = 0,
    ) -> bool:
        """Skip the vision state the fixed cadence schedules now (docs/engine.md, "Cadence")?

        `since`: vision blocks since the newest state handed to the writer (or restored);
        `blocks_left`: blocks of the phase still to run; `nbytes`: the state's size; the writer's
        backlog: `backlog_bytes` of ordered records queued or being written, of which the one
        being written (`writing_bytes`) has been under way `writing_s`.

        The state's write is estimated at r seconds per byte, r the larger of the measured
        vision-state rate (`write_rate`: the median of the latest writes, kept across boots)
        and the rate the record being written has not yet beaten
        (`writing_s` / `writing_bytes`: it is not done). Started once the writer has written its
        backlog, the write ends `end` from now. The state is skipped when, with p the chance of a
        cut within `end` plus one more such write (about when vision.out, as large as the state,
        could be durable after it), all hold: the adaptive cadence; the block time and r are
        measured; `end` is after the phase's last block (the prefill's records would queue
        behind it); `end` is after the blocks it adds over the newest state could be computed
        again (`since` x block time: writing it takes longer than redoing what it saves); and
        p < P_MIN (neither a warning, the telemetry nor the windows lived through say the cut
        is likely before vision.out is durable)."""
        if self.mode != "adaptive" or since <= 0 or blocks_left <= 0 or nbytes <= 0:
            return False
        rate = self.write_rate.get("vision")
        with self._lock:
            unit = self.unit_s.get("vision")
        if writing_bytes > 0 and writing_s > 0:
            rate = max(rate or 0.0, writing_s / writing_bytes)
        if unit is None or not rate:
            return False  # nothing measured yet: the fixed cadence's state
        write = nbytes * rate
        end = max(0.0, backlog_bytes * rate - writing_s) + write
        if end <= blocks_left * unit or end <= since * unit:
            return False
        if self.cut_probability(end + write) >= P_MIN:
            return False
        with self._lock:
            self.vision_states_skipped += 1
        return True

    def shapes_blocks(self, configured: int) -> bool:
        """Whether `prefill_group` can choose anything but `configured` now: the adaptive cadence,
        more than one layer configured, and enough windows lived through. The engine asks first,
        so that a task that cannot get another shape costs no cost-model lookup."""
        with self._lock:
            return self.mode == "adaptive" and configured > 1 and len(self.windows) >= MIN_WINDOWS

    def prefill_group(self, configured: int, layer_chunk_s: float) -> int:
        """Layers per prefill block for a task that has no record yet. The fixed cadence keeps
        `configured` (the paper's G). The adaptive one takes the largest G <= configured whose
        block, G x `layer_chunk_s` (one decoder layer on one chunk), fits in BLOCK_WINDOW_SHARE of
        the median window lived through; at least one layer. Chosen once per task: the MANIFEST
        keeps it, so every record of a task has one block shape and a resume reads it back."""
        if self.mode != "adaptive" or layer_chunk_s <= 0 or configured <= 1:
            return configured
        with self._lock:
            if len(self.windows) < MIN_WINDOWS:
                return configured
            median = _median(self.windows)
        return max(1, min(configured, int(BLOCK_WINDOW_SHARE * median / layer_chunk_s)))

    def describe(self) -> dict:
        with self._lock:
            return {
                "mode": self.mode,
                "windows": len(self.windows),
                "median_window_s": _median(self.windows) if self.windows else None,
                "warned": self.cut_at is not None,
                "early_records": self.early_records,
                "vision_states_skipped": self.vision_states_skipped,
            }
