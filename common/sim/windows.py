"""Power windows and the progress of a task across them (docs/ground.md, "Completion forecast").

The lifecycle simulator (hil/sim/lifecycle.py) models a request record by record with the real
policies and planners; the ground cannot run that (it may not import the flight software) and
does not need to: the payload reports what its own process measured -- seconds per durable unit
of each phase and the overhead of a power-up (boot, restore) -- so a task's remaining work is a
list of units, each lost if a cut comes before it is durable. This module walks such a list
across power windows. It is pure (standard library only) so that the ground, the testbench and
the benchmarks import the same code.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence

#: Windows walked before a forecast gives up (a unit longer than every window never completes).
MAX_WINDOWS = 5000


def trace_windows(trace) -> tuple[list[tuple[float, float]], dict]:
    """(windows, {cut time: warning time}) of a traces.Trace: (start, end) in trace seconds, the
    last window's end infinite where the trace ends powered."""
    windows, warns = [], {}
    for w in trace.windows():
        end = w.end_s if w.cut_cause is not None else math.inf
        windows.append((w.start_s, end))
        if w.cut_cause is not None and w.warning_lead_s > 0:
            warns[end] = w.end_s - w.warning_lead_s
    return windows, warns


def on_off_pairs(windows: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """(window length, gap after it) for each window followed by another."""
    return [(end - start, windows[i + 1][0] - end) for i, (start, end) in enumerate(windows[:-1])]


def finish_times(
    units: Sequence[float],
    marks: Sequence[int],
    windows: Iterable[tuple[float, float] | tuple[float, float, bool]],
    *,
    overhead_s: float,
    first_overhead_s: float = 0.0,
    max_windows: int = MAX_WINDOWS,
    parts: Sequence[int] | None = None,
) -> list[tuple[float, int] | None]:
    """For each mark m (a count of units, ascending), when the first m of `units` (seconds each,
    in order) are durable and in how many windows after the first; None where that does not
    happen within `max_windows`.

    The first window is the one the walk starts in: `first_overhead_s` is charged before its
    first unit (0 where the process is up and the work next); every later window pays
    `overhead_s` (boot, restore) first. A unit that does not end before its window's cut is lost
    and runs again from its start in the next window -- unless the window is (start, end, True):
    its cut was announced, and the payload persists at the next step boundary on a warning
    (Engine.checkpoint_soon), so of a unit made of `parts[i]` equal steps between records (a
    fixed cadence's decode record every D steps), the steps that ended before the cut are kept."""
    ends = list(itertools.accumulate(units))
    out: list[tuple[float, int] | None] = [None] * len(marks)
    pending = 0  # next mark to place
    while pending < len(marks) and marks[pending] <= 0:
        out[pending] = None
        pending += 1
    done = 0.0  # work made durable so far (seconds of units)
    for n, window in enumerate(itertools.islice(windows, max_windows)):
        if pending >= len(marks):
            break
        start, end = window[0], window[1]
        t = start + (first_overhead_s if n == 0 else overhead_s)
        if t >= end:
            continue
        # units that end by the cut: the largest k with ends[k-1] - done <= end - t
        reach = done + (end - t)
        k = bisect.bisect_right(ends, reach)
        while pending < len(marks) and marks[pending] <= k:
            out[pending] = (t + ends[marks[pending] - 1] - done, n)
            pending += 1
        if k > 0:
            done = max(done, ends[k - 1])
        if len(window) > 2 and window[2] and parts is not None and k < len(units) and parts[k] > 1:
            # announced cut: the unit in flight keeps its steps that ended (`done` may then lie
            # inside a unit; the next window goes on from there)
            step = units[k] / parts[k]
            begun = ends[k - 1] if k > 0 else 0.0
            done = max(done, begun + math.floor((reach - begun) / step + 1e-9) * step)
    return out


def finish_time(
    units: Sequence[float],
    windows: Iterable[tuple[float, float]],
    *,
    overhead_s: float,
    first_overhead_s: float = 0.0,
    max_windows: int = MAX_WINDOWS,
) -> tuple[float, int] | None:
    """When the last of `units` becomes durable, and how many windows after the first it took
    (`finish_times` with one mark); None if it never does within `max_windows`."""
    if not units:
        return None
    return finish_times(
        units, [len(units)], windows, overhead_s=overhead_s, first_overhead_s=first_overhead_s, max_windows=max_windows
    )[0]
