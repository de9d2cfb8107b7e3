"""Readable text and JSON for what the ground receives: one line per packet, housekeeping and
result summaries, the task list.

Text that came from the payload, the bus or an operator (event texts, reasons, result texts,
prompts, quarantine items) is printed through `common.wire.text.display_text`: control,
bidirectional, zero-width and other format characters appear as visible escapes (`\u202e`), so
nothing a sender writes can rewrite the terminal or reorder what is shown (docs/ground.md,
"What is printed"). JSON output (`json_text`) keeps every string exact and writes those same
characters as JSON escapes.
"""

from __future__ import annotations

import calendar
import dataclasses
import enum
import json
import time
from types import MappingProxyType
from typing import Any

from common.wire import MessageType, Severity
from common.wire import messages as m
from common.wire.ids import MAX_RECOVERIES
from common.wire.text import display_text, is_hidden
from ground.link import Telemetry


def to_jsonable(value: Any) -> Any:
    """Messages and field values as JSON-ready data: IntEnum codes by name, strings as is,
    bytes as hex, tuples as lists."""
    if isinstance(value, m.Message):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value if isinstance(value, str) else value.name
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (dict, MappingProxyType)):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    return value


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code > 0xFFFF:  # JSON escapes beyond the BMP as a UTF-16 surrogate pair
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


def json_text(data: Any) -> str:
    """`data` as one line of JSON for a terminal or a pipe: non-ASCII text as it is, except the
    characters `display_text` escapes, which are written as JSON escapes (`\\u202e`). Parsed,
    it gives back exactly `data`; printed, nothing in it acts on the terminal."""
    text = json.dumps(data, ensure_ascii=False, sort_keys=True)
    # Outside strings JSON is ASCII, so every hidden character found is inside a string, where
    # its escape means the same character.
    return "".join(_json_escape(ch) if is_hidden(ch) else ch for ch in text)


def iso_time(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{int(seconds * 1000) % 1000:03d}Z"


def packet_record(packet: Telemetry, number: int | None = None) -> dict:
    """One JSON line of `ow ground events --json` (and of the telemetry archive)."""
    h = packet.header
    record = {
        "n": number,
        "received": iso_time(packet.received_at),
        "sent": iso_time(h.time_us / 1e6),
        "type": packet.message.TYPE.name,
        "apid": h.apid,
        "source_id": h.source_id,
        "seq": h.seq,
        "via": packet.via,
        "digest": packet.digest,
        "body": to_jsonable(packet.message),
    }
    if isinstance(packet.message, m.Event):
        record["severity"] = _severity(packet.message).name
    return record


def _type_name(value: int) -> str:
    try:
        return MessageType(value).name
    except ValueError:
        return f"{value:#06x}"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def describe(message: m.Message) -> str:
    """The body of one packet in a few words (without time or type)."""
    if isinstance(message, m.Event):
        task = f" [{message.task_id}]" if message.task_id else ""
        return f"{_severity(message).name} {message.event_id.name}{task}: {message.text}"
    if isinstance(message, m.Verification):
        about = f"{_type_name(message.tc_type)} seq {message.tc_seq} from source {message.tc_source}"
        task = f" task {message.task_id}" if message.task_id else ""
        if isinstance(message, m.Rejected) and message.not_yet:
            # an answer, not a rejection (wire-protocol.md §3.6): what the task is doing
            return f"{about}{task}: not finished yet ({message.reason})"
        if isinstance(message, (m.Rejected, m.Failed)):
            return f"{about}{task}: {message.code.name} ({int(message.code)}): {message.reason}"
        if isinstance(message, m.Progress):
            return f"{about}{task}: {message.phase} {message.done}/{message.total}"
        return f"{about}{task}"
    if isinstance(message, m.Housekeeping):
        task = message.current_task or "-"
        phase = f" {message.phase} {message.progress_done}/{message.progress_total}" if message.phase else ""
        return (
            f"queue {message.queue_depth}, task {task}{phase}, checkpoints {human_bytes(message.checkpoint_bytes)}, "
            f"disk free {human_bytes(message.disk_free_bytes)}, boot {message.boot_count}, commands "
            f"{message.command_count}, "
            f"errors {message.error_count}, up {message.uptime_s:.1f} s{_memory_and_wear(message)}"
        )
    if isinstance(message, m.Heartbeat):
        task = f", task {message.current_task} {message.phase or ''}".rstrip() if message.current_task else ""
        return f"boot {message.boot_count}, up {message.uptime_s:.1f} s{task}"
    if isinstance(message, m.TaskResult):
        return f"task {message.task_id}: {len(message.token_ids)} tokens, {message.interruptions} interruptions"
    if isinstance(message, m.Pong):
        return f"key {message.key}"
    if isinstance(message, m.ImageStatus):
        if message.total == 0:
            return f"{message.image}: no chunk held"
        held = message.total - len(message.missing())
        return (
            f"{message.image}: {held}/{message.total} chunks of {message.image_size} "
            f"bytes{', verified' if message.verified else ''}"
        )
    if isinstance(message, m.PowerReport):
        state = "on" if message.payload_on else "OFF"
        return (
            f"payload {state}, bus {message.bus_voltage_v:.2f} V, payload {message.payload_power_w:.1f} W, "
            f"battery {message.battery_soc * 100:.0f} % (t={message.trace_time_s:.1f} s)"
        )
    if isinstance(message, m.ThermalReport):
        return (
            f"payload {message.payload_temp_c:.1f} degC, bus {message.bus_temp_c:.1f} degC "
            f"(t={message.trace_time_s:.1f} s)"
        )
    if isinstance(message, m.FdirReport):
        last = f", last fault: {message.last_fault}" if message.last_fault else ""
        return f"mode {message.mode}, {message.fault_count} faults{last} (t={message.trace_time_s:.1f} s)"
    if isinstance(message, m.ShutdownWarning):
        return f"payload power cut in {message.lead_time_s:.1f} s ({message.cause}) (t={message.trace_time_s:.1f} s)"
    if isinstance(message, m.PowerStateChange):
        state = "ON" if message.payload_on else "OFF"
        return f"payload power {state} ({message.cause}) (t={message.trace_time_s:.1f} s)"
    if isinstance(message, m.QuarantineList):
        items = ", ".join(f"{i} ({n})" for i, n in zip(message.items, message.exits, strict=True)) or "nothing"
        return f"{message.total} quarantined: {items}"
    if isinstance(message, m.LostTasks):
        return (
            f"{message.total} task(s) lost: {', '.join(message.task_ids) or '-'}; {message.bytes_dropped} damaged "
            f"bytes skipped in {message.records_dropped} region(s), {message.unnamed} unnamed"
        )
    if isinstance(message, m.PayloadProfile):
        rates = ", ".join(f"{k} {v:.3g} s" for k, v in message.unit_s.items()) or "no unit measured yet"
        return (
            f"{message.model or '-'} {message.policy} ({message.cadence}): {rates} per unit; power-up "
            f"{message.overhead_s:.1f} s, setup {message.setup_s:.1f} s"
        )
    if isinstance(message, m.WindowHistory):
        if not message.lengths:
            return f"boot {message.boot_count}: {len(message.starts)} window(s), none ended yet"
        lengths = sorted(message.lengths)
        return (
            f"boot {message.boot_count}: {len(message.lengths)} ended window(s), median "
            f"{lengths[len(lengths) // 2]:.1f} s (shortest {lengths[0]:.1f} s, longest {lengths[-1]:.1f} s)"
        )
    return str(to_jsonable(message))


def _severity(event: m.Event) -> Severity:
    """An event's severity (never None once decoded: Event fills it in from its id)."""
    assert event.severity is not None
    return event.severity


def packet_line(packet: Telemetry, number: int | None = None) -> str:
    """`#n  2025-01-01T12:00:00.123Z  PAYLOAD  EVENT  WARNING_HI TASK_FAILED [t-x]: ...`"""
    origin = {0x010: "BUS", 0x020: "PAYLOAD"}.get(packet.header.apid, f"APID{packet.header.apid:#05x}")
    prefix = f"#{number} " if number is not None else ""
    return display_text(
        f"{prefix}{iso_time(packet.header.time_us / 1e6)} {origin:<7} {shown_type(packet.message):<16} "
        f"{describe(packet.message)}"
    )


def shown_type(message: m.Message) -> str:
    """The type column of a line: the packet's type, except NOT_READY for the "not yet" answer
    to a DOWNLINK_RESULT, which is sent as a REJECTED report but rejects nothing."""
    if isinstance(message, m.Rejected) and message.not_yet:
        return NOT_READY
    return message.TYPE.name


NOT_READY = "NOT_READY"


def _archived_type(entry: dict) -> str:
    body = entry.get("body") or {}
    if (
        entry.get("type") == "REJECTED"
        and body.get("code") == "RESULT_NOT_READY"
        and body.get("tc_type") in (int(MessageType.DOWNLINK_RESULT), "DOWNLINK_RESULT")
    ):
        return NOT_READY
    return str(entry.get("type", "?"))


#: `events` prints a POWER or THERMAL report at most this often (sender's seconds) while the
#: payload's power state stays the same: their values drift every second.
ROUTINE_EVERY_S = 60.0
ROUTINE_TYPES = ("FDIR", "POWER", "THERMAL")


class RoutineFilter:
    """Which routine reports `ow ground events` prints (docs/ground.md "events"): the bus sends an
    FDIR, a POWER and a THERMAL report every second, and on a quiet bus they were most of what an
    operator read (65 % of lines were "FDIR mode nominal, 0 faults"). An FDIR report is printed
    when its mode, fault count or last fault differs from the last one printed; a POWER report
    when the payload's power state differs, else once per ROUTINE_EVERY_S; a THERMAL report once
    per ROUTINE_EVERY_S. Every other packet is printed. Only printing is filtered: the archive
    keeps every packet."""

    def __init__(self, every_s: float = ROUTINE_EVERY_S):
        self.every_s = every_s
        self._last: dict[str, tuple[tuple, float]] = {}

    def show(self, type_name: str, body: dict, sent_s: float) -> bool:
        if type_name not in ROUTINE_TYPES:
            return True
        if type_name == "FDIR":
            state: tuple = (body.get("mode"), body.get("fault_count"), body.get("last_fault"))
        elif type_name == "POWER":
            state = (body.get("payload_on"),)
        else:
            state = ()
        last = self._last.get(type_name)
        if last is not None and last[0] == state and (type_name == "FDIR" or sent_s - last[1] < self.every_s):
            return False
        self._last[type_name] = (state, sent_s)
        return True

    def show_packet(self, packet: Telemetry) -> bool:
        name = packet.message.TYPE.name
        if name not in ROUTINE_TYPES:
            return True
        return self.show(name, to_jsonable(packet.message), packet.header.time_us / 1e6)

    def show_entry(self, entry: dict) -> bool:
        name = str(entry.get("type"))
        if name not in ROUTINE_TYPES:
            return True
        try:
            sent = float(calendar.timegm(time.strptime(str(entry.get("sent"))[:19], "%Y-%m-%dT%H:%M:%S")))
        except ValueError:
            sent = 0.0
        return self.show(name, dict(entry.get("body") or {}), float(sent))


def archived_line(entry: dict) -> str:
    """The text line for an archived packet (`events --since`)."""
    body = entry.get("body", {})
    origins: dict[object, str] = {0x010: "BUS", 0x020: "PAYLOAD"}  # looked up with whatever was archived
    origin = origins.get(entry.get("apid"), f"APID{entry.get('apid')}")
    text = entry.get("text") or ", ".join(f"{k}={v}" for k, v in body.items())
    return display_text(f"#{entry.get('n')} {entry.get('sent')} {origin:<7} {_archived_type(entry):<16} {text}")


def _storage_line(hk: m.Housekeeping) -> str:
    """The payload's storage state (docs/flight.md "Storage"), with what it means for commands."""
    meaning = {
        "ok": "ok",
        "full": "FULL: new tasks and images refused, checkpoints skipped until space returns",
        "read_only": "READ-ONLY: commands that change state refused, no task started",
        "error": "FAILING (I/O errors): commands that change state refused, no task started",
    }[hk.storage_state.value]
    extra = [f"reserve {human_bytes(hk.reserve_bytes)}"]
    if hk.longest_write_s >= 1.0:
        extra.append(f"a write took {hk.longest_write_s:.1f} s (disk stalling)")
    return f"{meaning} ({', '.join(extra)})"


def _memory_and_wear(hk: m.Housekeeping) -> str:
    """ ", memory X, written Y this boot" with what the payload reported (an older payload
    reports neither: wire-protocol.md §3.3)."""
    parts = []
    if hk.memory_rss_bytes is not None:
        parts.append(f"memory {human_bytes(hk.memory_rss_bytes)}")
    if hk.written_bytes is not None:
        parts.append(f"written {human_bytes(hk.written_bytes)} this boot")
    return "".join(", " + p for p in parts)


def housekeeping_text(hk: m.Housekeeping) -> str:
    if hk.current_task:
        phase = f" ({hk.phase} {hk.progress_done}/{hk.progress_total})" if hk.phase else ""
        current = f"{hk.current_task}{phase}"
    else:
        current = "none"
    rows = [
        ("queue depth", f"{hk.queue_depth} task(s)"),
        ("current task", current),
        ("checkpoints", human_bytes(hk.checkpoint_bytes)),
        ("disk free", human_bytes(hk.disk_free_bytes)),
        ("storage", _storage_line(hk)),
        (
            "written",
            "not reported (older payload)"
            if hk.written_bytes is None
            else f"{human_bytes(hk.written_bytes)} to data storage since this boot",
        ),
        (
            "memory",
            "not reported (older payload)"
            if hk.memory_rss_bytes is None
            else f"{human_bytes(hk.memory_rss_bytes)} resident",
        ),
        ("boot count", str(hk.boot_count)),
        ("uptime", f"{hk.uptime_s:.1f} s"),
        ("commands", f"{hk.command_count} accepted, {hk.error_count} rejected or failed (since first boot)"),
    ]
    return "\n".join(f"{k:<14}{display_text(v)}" for k, v in rows)


def result_text(result: m.TaskResult) -> str:
    lines = [
        f"task          {display_text(result.task_id)}",
        f"tokens        {len(result.token_ids)}",
        f"interruptions {result.interruptions} power cut(s) survived",
    ]
    if result.timings:
        timing = ", ".join(f"{k} {v:.3f} s" for k, v in result.timings.items())
        lines.append(f"timings       {display_text(timing)}")
    lines.extend(recovery_lines(result))
    lines.append(f"logits sha256 {bytes(result.logits_sha256).hex()}")
    lines.append("text:")
    # The answer is a block: its line feeds and tabs stay, every other hidden character shows.
    lines.append(display_text(result.text, keep_newlines=True))
    return "\n".join(lines)


def recovery_lines(result: m.TaskResult) -> list[str]:
    """Each restart (time to find where to resume, the phase it resumed in, its recovery plan)
    and the checkpoint bytes written over every boot; "not reported" for an older payload."""
    recoveries = result.recoveries
    if recoveries is None:
        lines = ["recoveries    not reported (older payload)"]
    elif not recoveries:
        lines = ["recoveries    none (never restarted)"]
    else:
        latest = " (the latest; the payload sends at most that many)" if len(recoveries) >= MAX_RECOVERIES else ""
        lines = [f"recoveries    {len(recoveries)} restart(s){latest}: time to resume, phase resumed in, plan"]
        for index, (seconds, phase, planner) in enumerate(recoveries, start=1):
            lines.append(display_text(f"  #{index:<11}{seconds:.3f} s  {phase:<8} {planner}"))
    written = result.written_bytes
    lines.append(
        "written       not reported (older payload)"
        if written is None
        else f"written       {human_bytes(written)} of checkpoint records over every boot ({written} B)"
    )
    return lines


def result_json(result: m.TaskResult) -> dict:
    """The result as JSON data, with its restarts also as one object each."""
    data = to_jsonable(result)
    recoveries = result.recoveries
    data["recoveries"] = (
        None
        if recoveries is None
        else [{"restore_s": seconds, "phase": phase, "planner": planner} for seconds, phase, planner in recoveries]
    )
    return data


def tasks_table(tasks: list[dict]) -> str:
    if not tasks:
        return "no tasks uplinked from this station yet"
    header = f"{'TASK':<14} {'STATE':<12} {'PRIO':>4} {'IMAGES':>6} {'CREATED (UTC)':<19} PROMPT"
    rows = [header]
    for t in tasks:
        prompt = " ".join(str(t.get("prompt", "")).split())
        if len(prompt) > 48:
            prompt = prompt[:45] + "..."
        rows.append(
            display_text(
                f"{t['task_id']:<14} {t.get('state', '?'):<12} {t.get('priority', 0):>4} "
                f"{len(t.get('images', [])):>6} {str(t.get('created', ''))[:19]:<19} {prompt}"
            )
        )
    return "\n".join(rows)
