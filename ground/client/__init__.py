"""`GroundClient`: every ground operation, callable in-process (the CLI is a thin layer on it).

    options = GroundOptions(endpoints=Endpoints(commands=..., telemetry=...), timeout_s=20.0)
    with GroundClient("keys", options) as ground:
        rtt = ground.ping()
        hk = ground.status()
        up = ground.uplink(["a.png"], "describe the coast", max_new_tokens=32)
        result = ground.result(up.task_id, wait=True)

Answers are correlated by request id (APID, source id, sequence number, type) and task id, from
the commands link and the telemetry link alike (ground.link). Nothing here assumes an answer
comes back: every wait has a timeout, and an uplink that stops hearing back re-asks the payload
what it holds (IMAGE_QUERY) and sends only what is missing, so it resumes after link loss, a bus
restart or a payload power cut without sending a held chunk again or queueing a task twice.

Where things are (`GroundClient` composes them; each part is given the parts it uses):

    options.py        GroundOptions: the client's settings, typed, frozen, checked once
    session.py        link, arrivals, command/reply matching (CommandSession, Arrivals)
    upload.py         resumable image upload (ImageUploader on the session; ImageUpload)
    tasks.py          uplink, task list, resend/cancel/priority (TaskTracker on the session and
                      the uploader; UplinkResult)
    results.py        DOWNLINK_RESULT, waiting, local storage (ResultStore on the session and the
                      tracker)
    ground_client.py  GroundClient: the parts put together; ping, status, quarantine, lost tasks,
                      telemetry
"""

from ground.client.ground_client import GroundClient
from ground.client.options import DEFAULT_RETRIES, DEFAULT_TIMEOUT_S, DEFAULT_WINDOW, GroundOptions
from ground.client.results import ResultStore
from ground.client.session import (
    DEFAULT_MAX_NEW_TOKENS,
    REPORT_MEMORY,
    RESYNC_CODES,
    Arrivals,
    CommandSession,
    request_dict,
    request_from_dict,
)
from ground.client.tasks import FINAL_TASK_STATES, TaskTracker, UplinkResult
from ground.client.upload import ImageUpload, ImageUploader
from ground.errors import GroundError

__all__ = [
    "Arrivals",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_RETRIES",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_WINDOW",
    "FINAL_TASK_STATES",
    "REPORT_MEMORY",
    "RESYNC_CODES",
    "CommandSession",
    "GroundClient",
    "GroundError",
    "GroundOptions",
    "ImageUpload",
    "ImageUploader",
    "ResultStore",
    "TaskTracker",
    "UplinkResult",
    "request_dict",
    "request_from_dict",
]
