"""One valid instance of every message type, shared by the wire tests."""

from __future__ import annotations

import hashlib
from typing import Any

from common.wire import messages as m
from common.wire.ids import EventId, FdirMode, ResponseCode, TaskPhase
from hil.redteam import sample_commands

_REQ: dict[str, Any] = dict(tc_apid=0x020, tc_source=1, tc_seq=16384 + 5, tc_type=0x0110)


def sample_messages() -> list[m.Message]:
    """The telecommands the red team also sends (one list, kept in hil.redteam), the bus's own
    telecommand, then one of every telemetry message."""
    return sample_commands() + [
        m.PayloadRetry(),
        m.Accepted(**_REQ, task_id="task-001"),
        m.Rejected(**_REQ, code=ResponseCode.REPLAYED_SEQUENCE, reason="seq 5 already accepted", highest_seq=16390),
        m.Started(**_REQ),
        m.Progress(**_REQ, phase=TaskPhase.PREFILL, done=3, total=12),
        m.Completed(**_REQ, task_id="task-001"),
        m.Failed(**_REQ, code=ResponseCode.INFERENCE_ERROR, reason="out of memory"),
        m.Housekeeping(
            queue_depth=2,
            current_task="task-001",
            phase=TaskPhase.DECODE,
            progress_done=10,
            progress_total=64,
            checkpoint_bytes=123_456_789_012,
            disk_free_bytes=2**40,
            boot_count=3,
            command_count=17,
            error_count=1,
            uptime_s=12.5,
            memory_rss_bytes=734_003_200,
            written_bytes=2**33 + 5,
        ),
        m.Event(
            event_id=EventId.TASK_RESUMED, text="resumed after power cut at prefill block (2, 3)", task_id="task-001"
        ),
        m.TaskResult(
            task_id="task-001",
            token_ids=[1, 2, 3, 151643],
            text="Scattered cumulus.",
            logits_sha256=hashlib.sha256(b"logits").digest(),
            timings={"prefill": 1.25, "decode": 3.0},
            interruptions=2,
            recovery_s=[0.0125, 0.5],
            recovery_phases=["prefill", "decode"],
            recovery_planners=["optimal", "layer-first"],
            written_bytes=5_000_000_123,
        ),
        m.Heartbeat(boot_count=3, uptime_s=1.0, current_task=None, phase=None),
        m.Pong(key=0xDEADBEEF),
        m.ImageStatus.of("img_a.png", image_size=768, total=3, received_indices=[0, 2]),
        m.PowerReport(trace_time_s=100.0, payload_on=True, bus_voltage_v=28.1, payload_power_w=15, battery_soc=0.8),
        m.ThermalReport(trace_time_s=100.0, payload_temp_c=41.5, bus_temp_c=-10.0),
        m.FdirReport(trace_time_s=100.0, mode=FdirMode.NOMINAL, fault_count=0),
        m.QuarantineList(
            items=["task:task-001", "command:PING:0123456789abcdef"],
            exits=[3, 3],
            reasons=["boot 4 ended by itself", "injected fault"],
            total=2,
        ),
        m.LostTasks(task_ids=["task-002"], total=1, bytes_dropped=336, records_dropped=1, unnamed=0),
        m.PayloadProfile(
            model="qwen3-vl-2b",
            policy="orbitweaver",
            cadence="fixed",
            unit_s={"vision": 0.4, "prefill": 0.6, "decode": 0.05},
            task_units={"vision": 4, "prefill": 28, "decode": 64},
            durable_every={"vision": 2, "decode": 8},
            decode_tokens=64,
            overhead_s=2.5,
            setup_s=0.3,
        ),
        m.WindowHistory(boot_count=3, starts=[1764900000.0, 1764900040.5, 1764900100.25], lengths=[30.0, 42.5]),
    ]
