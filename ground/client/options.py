"""`GroundOptions`: how a `GroundClient` (and its `CommandSession`) talks to the bus, as one frozen,
typed value, checked once when it is made.

A value that cannot work is refused here with a `LocalInputError` (exit 5 from `ow ground`, as any
bad local input), before a key is read or a socket opened: the CLI checks its own flags first and
names them (`--timeout must be ...`); an in-process caller gets the field's name instead.
Overrides (the console's per-action ones) are made with `dataclasses.replace`, which checks again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from common.errors import check_number
from common.wire.ids import DEFAULT_CHUNK_DATA_BYTES
from common.wire.link import Endpoints
from ground.errors import LocalInputError
from ground.images import check_chunk_bytes, check_operator_name
from ground.link import DEFAULT_HANDSHAKE_TIMEOUT_S

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_RETRIES = 12
DEFAULT_WINDOW = 8


@dataclass(frozen=True, kw_only=True)
class GroundOptions:
    """Everything about a ground client but its keys directory; every field has today's default."""

    #: client key name (clients/<station>.key_secret)
    station: str = "ground"
    #: the secondary-header source id (own replay window, 1..255); None: the one the bus binds to
    #: the station's key (docs/ground.md "Stations"), the first ground station's for a keys
    #: directory from before bindings
    source_id: int | None = None
    #: the bus's commands and telemetry endpoints; None: from the environment (Endpoints.from_env)
    endpoints: Endpoints | None = None
    #: the station's local state; None: the keys directory's state/
    state_dir: str | os.PathLike | None = None
    #: how long to wait for an answer before calling it "no answer" (s)
    timeout_s: float = DEFAULT_TIMEOUT_S
    #: how long opening the link waits for the CURVE handshake with the bus (s); separate from
    #: timeout_s, so a short answer wait does not also fail the connection to a bus slow to accept
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    #: unanswered rounds an uplink tolerates (re-asking each time) before giving up
    retries: int = DEFAULT_RETRIES
    #: IMAGE_CHUNKs in flight at once
    window: int = DEFAULT_WINDOW
    #: image bytes per IMAGE_CHUNK
    chunk_bytes: int = DEFAULT_CHUNK_DATA_BYTES
    #: where operator notices go; None: structlog warnings
    notify: Callable[[str], None] | None = None
    #: tqdm bar on stderr during uploads: True, False, or None (only on a terminal)
    progress: bool | None = False
    #: the ZeroMQ context the links use; None: a context of their own
    context: zmq.Context | None = None
    #: open the commands link too; False: telemetry only (the console's listener)
    commands: bool = True
    #: who sends, in the station's command log (`ow ground uplink`, ...); None: the program's name
    origin: str | None = None
    #: called with (image name, bytes on board, image size) as an upload advances
    upload_progress: Callable[[str, int, int], None] | None = None

    def __post_init__(self) -> None:
        check_operator_name(self.station, "station name")
        if self.source_id is not None and not 1 <= int(self.source_id) <= 0xFF:
            raise LocalInputError(f"source id {self.source_id} outside 1..255 (ground stations)")
        check_number(self.timeout_s, "timeout_s", above=0, error=LocalInputError)
        check_number(self.handshake_timeout_s, "handshake_timeout_s", above=0, error=LocalInputError)
        if self.retries < 0:
            raise LocalInputError(f"retries must be >= 0, not {self.retries!r}")
        if self.window < 1:
            raise LocalInputError(f"window must be >= 1, not {self.window!r}")
        check_chunk_bytes(self.chunk_bytes)


__all__ = ["DEFAULT_RETRIES", "DEFAULT_TIMEOUT_S", "DEFAULT_WINDOW", "GroundOptions"]
