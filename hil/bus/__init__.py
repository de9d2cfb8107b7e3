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

Where things are (one concern per module). `Bus` is composed, not stacked: it owns the shared
state (base.py) and one object per part, each handed only what it uses; no part inherits from
another or calls another's private methods (tests/test_architecture.py checks it):

    config.py       BusConfig, its checks, the payload's command line
    clock.py        TraceClock, the trace's actions (trace_actions)
    base.py         what the parts share: PayloadLink, FdirChannels, GroundExchanges, StopRequest, and BusIO (what
                    start() opens: store, numbering, sockets, run log, switch; the run-log stamp
                    and the packet primitives)
    telemetry.py    power / thermal / FDIR reports (Telemetry)
    power_fdir.py   the power switch, FDIR, the boot-loop guard (PowerFdir)
    timeline.py     trace actions falling due, warnings, skip-idle (Timeline)
    routing.py      reports back to the ground connection that asked (Routing)
    stations.py     keys and revocation, source binding, rates, quotas, refusal logging (Stations)
    storage.py      the bus's own disk: failing writers, events, telemetry numbers (StorageWatch)
    relay.py        ground -> store -> payload, fair forwarding, payload packets in (Relay)
    lifecycle.py    Bus: the parts composed; start, main loop, shutdown; machine_fingerprint
    runners.py      BusThread, BusProcess, config_to_argv
    power.py        the power-switch drivers (local, command, ssh)
    zygote.py       the local switch's pre-loaded fork server
    busstore.py     CommandStore: ground commands kept while the payload is off
    buslog.py       the run log (written here, read by replay, campaigns and tests)
    cli.py          `ow bus run` (not imported here: `ow --help` loads it alone)
"""

from hil.bus.base import (
    BusIO,
    FdirChannels,
    GroundExchanges,
    NotStarted,
    Pacer,
    PayloadLink,
    StationWait,
    StopRequest,
    request_fields,
)
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
from hil.bus.power_fdir import SWITCH_RETRY_S, PowerFdir
from hil.bus.relay import GROUND_SOURCE_IDS, Relay
from hil.bus.routing import REPLY_EXPECTATION_S, REPLY_TO, ROUTES_KEPT, ReplyExpectation, Routing
from hil.bus.runners import BusProcess, BusThread, config_to_argv
from hil.bus.stations import Stations
from hil.bus.storage import StorageWatch, TolerantSequenceCounter
from hil.bus.telemetry import Telemetry
from hil.bus.timeline import GROUND_QUIET_S, IDLE_CONFIRM_S, POLL_MAX_S, SKIP_MIN_S, Timeline

__all__ = [
    "FLIGHT_RUN_ARGS",
    "GROUND_QUIET_S",
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
    "BusConfig",
    "BusConfigError",
    "BusIO",
    "BusProcess",
    "BusThread",
    "FdirChannels",
    "GroundExchanges",
    "NotStarted",
    "Pacer",
    "PayloadLink",
    "PowerFdir",
    "Relay",
    "ReplyExpectation",
    "Routing",
    "StationWait",
    "Stations",
    "StopRequest",
    "StorageWatch",
    "Telemetry",
    "Timeline",
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
