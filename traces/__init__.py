"""Interruption traces: format, loader, validator, physical generator and telemetry importer.

The format is specified in docs/trace-format.md. Typical use by the testbench:

    import traces
    trace = traces.load("trace-a")                 # a shipped name or a path
    replay = trace.scaled(request_s / trace.reference_request_s)
    for window in replay.windows(): ...            # PowerWindow(start_s, end_s, cut_cause, warning_lead_s)
    long_run = traces.generate("trace-b", seed=7, duration_s=72 * 3600)
"""

from traces.catalog import DATA_DIR, SHIPPED_NAMES, resolve, shipped_path
from traces.format import (
    Problem,
    TraceError,
    dump,
    dumps,
    load,
    loads,
    parse_lines,
    trace_problems,
    trace_to_lines,
    validate,
    validate_lines,
)
from traces.model import (
    FORMAT_NAME,
    FORMAT_VERSION,
    TELEMETRY_COLUMNS,
    Cut,
    CutCause,
    Event,
    EventKind,
    PowerWindow,
    TelemetrySample,
    Trace,
    TraceStats,
)
from traces.presets import PRESETS, SHIPPED_SEEDS, generate

__all__ = [
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PRESETS",
    "SHIPPED_NAMES",
    "SHIPPED_SEEDS",
    "TELEMETRY_COLUMNS",
    "Cut",
    "CutCause",
    "Event",
    "EventKind",
    "PowerWindow",
    "Problem",
    "TelemetrySample",
    "Trace",
    "TraceError",
    "TraceStats",
    "dump",
    "dumps",
    "generate",
    "load",
    "loads",
    "parse_lines",
    "resolve",
    "shipped_path",
    "trace_problems",
    "trace_to_lines",
    "validate",
    "validate_lines",
]
