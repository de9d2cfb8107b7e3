"""`GroundClient`: the parts put together (composed, each part holding what it uses), with the
simple commands and the telemetry stream."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Self

from common.wire import Apid, RequestRef
from common.wire import messages as m
from ground.client.options import GroundOptions
from ground.client.results import ResultStore
from ground.client.session import DEFAULT_MAX_NEW_TOKENS, CommandSession, after
from ground.client.tasks import TaskTracker, UplinkResult
from ground.client.upload import ImageUpload, ImageUploader
from ground.errors import NoAnswer
from ground.images import PreparedImage
from ground.link import GroundLink, Telemetry
from ground.state import GroundState


class GroundClient:
    """One ground station's session with the bus and, through it, the payload.

    keys_dir      keys directory (clients/<station>.key_secret, server/bus.key, state/)
    options       GroundOptions: station, source id, endpoints, timeouts, retries, upload window,
                  notices, progress, origin, ... (default: GroundOptions(), each field's default)

    It is the parts put together, each holding only what it uses: the session (link, arrivals,
    command/reply matching), the uploader (on the session), the task tracker (on the session and
    the uploader) and the result store (on the session and the tracker). Not for use from two
    threads at once: one client per thread, as the console opens one per action.
    """

    def __init__(self, keys_dir: str | os.PathLike, options: GroundOptions | None = None):
        self.session = CommandSession(keys_dir, options)
        self.uploader = ImageUploader(self.session)
        self.tracker = TaskTracker(self.session, self.uploader)
        self.results = ResultStore(self.session, self.tracker)

    # --- lifecycle ------------------------------------------------------------------------------
    def open(self) -> Self:
        """Connect to the bus (CURVE handshake on both links); idempotent. Raises LinkRefused
        (key not authorized), NoAnswer (no bus) or LocalInputError (keys missing)."""
        self.session.open()
        return self

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    # --- what the session holds, as callers read it ---------------------------------------------
    @property
    def state(self) -> GroundState:
        """The station's local state (task list, results, counters, command log)."""
        return self.session.state

    @property
    def link(self) -> GroundLink:
        return self.session.link

    @property
    def station(self) -> str:
        return self.session.station

    @property
    def source_id(self) -> int:
        return self.session.source_id

    @property
    def timeout_s(self) -> float:
        """How long a command waits for its answer; may be changed between commands."""
        return self.session.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        self.session.timeout_s = float(seconds)

    @property
    def observers(self) -> list[Callable]:
        """Called with every packet as it arrives (the console's live view)."""
        return self.session.observers

    @property
    def payload_on(self) -> bool | None:
        return self.session.payload_on

    # --- images, tasks and results (the parts') ---------------------------------------------------
    def query_image(self, name: str) -> m.ImageStatus:
        return self.uploader.query_image(name)

    def upload_image(self, image: PreparedImage) -> ImageUpload:
        return self.uploader.upload_image(image)

    def uplink(
        self,
        image_paths: list[str],
        prompt: str,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        priority: int = 0,
        task_id: str | None = None,
        new_task: bool = False,
    ) -> UplinkResult:
        """Check locally, upload the images (missing chunks only), queue the task (TaskTracker.uplink)."""
        return self.tracker.uplink(
            image_paths, prompt, max_new_tokens=max_new_tokens, priority=priority, task_id=task_id, new_task=new_task
        )

    def queue_task(
        self, task_id: str, prompt: str, images: list[str], max_new_tokens: int, priority: int
    ) -> RequestRef:
        return self.tracker.queue_task(task_id, prompt, images, max_new_tokens, priority)

    def resend(self, task_id: str) -> UplinkResult:
        return self.tracker.resend(task_id)

    def cancel(self, task_id: str) -> None:
        self.tracker.cancel(task_id)

    def set_priority(self, task_id: str, priority: int) -> None:
        self.tracker.set_priority(task_id, priority)

    def tasks(self) -> list[dict]:
        """Tasks this station uplinked (local state), oldest first."""
        return self.tracker.tasks()

    def result(
        self, task_id: str, *, wait: bool = False, max_wait_s: float | None = None, poll_s: float = 30.0
    ) -> m.TaskResult:
        return self.results.result(task_id, wait=wait, max_wait_s=max_wait_s, poll_s=poll_s)

    def ping(self) -> float:
        """PING -> PONG; the round-trip time in seconds."""
        key = random.getrandbits(32)
        started = time.time()
        self.session.transact(
            m.Ping(key=key), "PING", reply=lambda mark: after(self.session.arrivals.pongs.get(key), mark)
        )
        return self.session.arrivals.pongs[key][1] - started

    def status(self) -> m.Housekeeping:
        """STATUS -> the next HOUSEKEEPING report (any report after the request is current)."""
        _, hk = self.session.transact(
            m.Status(), "STATUS", reply=lambda mark: after(self.session.arrivals.housekeeping, mark)
        )
        return hk

    # --- health and safety ---------------------------------------------------------------------
    def quarantine(self) -> m.QuarantineList:
        """LIST_QUARANTINE -> the items the payload holds back after repeated abnormal exits."""
        _, listing = self.session.transact(
            m.ListQuarantine(), "LIST_QUARANTINE", reply=lambda mark: after(self.session.arrivals.quarantine, mark)
        )
        return listing

    def release(self, item: str) -> None:
        """RELEASE_QUARANTINE: the payload handles `item` again (a task is queued again)."""
        self.session.transact(m.ReleaseQuarantine(item=item), f"RELEASE_QUARANTINE {item}", completion=True)

    def lost_tasks(self) -> m.LostTasks:
        """LIST_LOST_TASKS -> the tasks the payload lost to storage damage."""
        _, lost = self.session.transact(
            m.ListLostTasks(), "LIST_LOST_TASKS", reply=lambda mark: after(self.session.arrivals.lost, mark)
        )
        return lost

    # --- the bus's boot-loop guard ----------------------------------------------------------------
    def payload_retry(self) -> None:
        """PAYLOAD_RETRY, to the bus (APID BUS): power the payload again now that the bus holds it
        off after a boot loop. CommandRejected NOT_HELD (by the bus) when nothing is held."""
        try:
            self.session.transact(m.PayloadRetry(), "PAYLOAD_RETRY", completion=True, apid=Apid.BUS)
        except NoAnswer:
            # The bus answers this itself (the payload may well be off): silence is the bus's.
            raise NoAnswer(f"PAYLOAD_RETRY: no answer from the bus within {self.session.timeout_s:g} s") from None

    # --- telemetry ----------------------------------------------------------------------------
    def telemetry(self, duration_s: float | None = None) -> Iterator[Telemetry]:
        """Every packet received, as it arrives, for `duration_s` (None: until the caller stops)."""
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while True:
            remaining = 0.5 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            for packet in self.session.link.receive(min(remaining, 0.5)):
                self.session.note(packet)
                yield packet
