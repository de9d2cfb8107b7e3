"""The mock spacecraft bus (docs/bus.md).

It owns the payload's power switch and replays an interruption trace against it: it powers the
payload up at each `power_on`, warns it before announced cuts, cuts it (SIGKILL) at each `cut`;
it publishes power / thermal / FDIR telemetry; it relays ground telecommands to the payload and
the payload's reports back, storing commands durably while the payload is off; and it power-
cycles a payload whose heartbeat stops (FDIR). Every run appends a run log (hil.bus.buslog).

    from hil.bus import Bus, BusConfig
    bus = Bus(BusConfig(trace="trace-a", data_dir=..., keys_dir=..., time_scale=0.01, model=...))
    bus.start()           # binds the three sockets; bus.endpoints tells where
    bus.run()             # until request_stop() / SIGTERM, or the trace end with stop_at_end

`BusThread` runs one in a background thread, `BusProcess` as a child process (`ow bus run`).

Where things are (one concern per module; `Bus` is built up from them in this order):

    config.py       BusConfig, its checks, the payload's command line
    clock.py        TraceClock, the trace's actions (trace_actions)
    base.py         shared state, run-log stamp, packet primitives (BusBase)
    telemetry.py    power / thermal / FDIR reports (TelemetryPart)
    power_fdir.py   the power switch and FDIR (PowerPart)
    timeline.py     trace actions falling due, warnings, skip-idle (TimelinePart)
    routing.py      reports back to the ground connection that asked (RoutingPart)
    stations.py     keys and revocation, source binding, rates, quotas, refusal logging (StationsPart)
    storage.py      the bus's own disk: failing writers, events, telemetry numbers (StorageWatch)
    relay.py        ground -> store -> payload, fair forwarding, payload packets in (RelayPart)
    lifecycle.py    Bus: start, main loop, shutdown; machine_fingerprint
    runners.py      BusThread, BusProcess, config_to_argv
    power.py        the power-switch drivers (local, command, ssh)
    zygote.py       the local switch's pre-loaded fork server
    busstore.py     CommandStore: ground commands kept while the payload is off
    buslog.py       the run log (written here, read by replay, campaigns and tests)
    cli.py          `ow bus run` (not imported here: `ow --help` loads it alone)
"""

from hil.bus.base import BusBase, Pacer, request_fields
from hil.bus.clock import TRACE_CAUSE, TraceAction, TraceClock, trace_actions
from hil.bus.config import (
    FLIGHT_RUN_ARGS,
    PAYLOAD_CLIENT,
    PLACEHOLDERS,
    REMOTE_PAYLOAD_COMMAND,
    BusConfig,
    BusConfigError,
    default_payload_command,
    expand_command,
)
from hil.bus.lifecycle import Bus, machine_fingerprint
from hil.bus.power_fdir import SWITCH_RETRY_S, PowerPart
from hil.bus.relay import GROUND_SOURCE_IDS, RelayPart
from hil.bus.routing import REPLY_EXPECTATION_S, REPLY_TO, ROUTES_KEPT, ReplyExpectation, RoutingPart
from hil.bus.runners import BusProcess, BusThread, config_to_argv
from hil.bus.stations import StationsPart
from hil.bus.storage import StorageWatch, TolerantSequenceCounter
from hil.bus.telemetry import TelemetryPart
from hil.bus.timeline import IDLE_CONFIRM_S, POLL_MAX_S, SKIP_MIN_S, TimelinePart

__all__ = [
    "FLIGHT_RUN_ARGS",
    "GROUND_SOURCE_IDS",
    "IDLE_CONFIRM_S",
    "PAYLOAD_CLIENT",
    "PLACEHOLDERS",
    "POLL_MAX_S",
    "REMOTE_PAYLOAD_COMMAND",
    "REPLY_EXPECTATION_S",
    "REPLY_TO",
    "ROUTES_KEPT",
    "SKIP_MIN_S",
    "SWITCH_RETRY_S",
    "TRACE_CAUSE",
    "Bus",
    "BusBase",
    "BusConfig",
    "BusConfigError",
    "BusProcess",
    "BusThread",
    "Pacer",
    "PowerPart",
    "RelayPart",
    "ReplyExpectation",
    "RoutingPart",
    "StationsPart",
    "StorageWatch",
    "TelemetryPart",
    "TimelinePart",
    "TolerantSequenceCounter",
    "TraceAction",
    "TraceClock",
    "config_to_argv",
    "default_payload_command",
    "expand_command",
    "machine_fingerprint",
    "request_fields",
    "trace_actions",
]
