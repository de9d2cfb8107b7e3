"""Task tracking: uplink (local checks, image upload, UPLINK_TASK until accepted), the station's
task list in local state (ground.state), and the commands about a queued task."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from common.wire import RequestRef
from common.wire import messages as m
from ground.client.session import DEFAULT_MAX_NEW_TOKENS, CommandSession, request_dict, request_from_dict
from ground.client.upload import ImageUpload, ImageUploader
from ground.errors import CommandRejected, LocalInputError, NoAnswer
from ground.images import (
    check_chunk_bytes,
    check_max_new_tokens,
    check_operator_name,
    check_priority,
    check_prompt,
    new_task_id,
    prepare_images,
)

FINAL_TASK_STATES = ("completed", "failed", "cancelled")


@dataclass
class UplinkResult:
    """What an uplink did: the task, the UPLINK_TASK that queued it, and each image's upload."""

    task_id: str
    #: request id of the UPLINK_TASK the payload accepted
    request: dict
    #: the task id came from an earlier identical uplink (nothing new was queued)
    reused_task_id: bool
    images: list[ImageUpload] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


class TaskTracker:
    """Queue tasks, keep the task list, re-send, cancel, re-prioritise: over a session's link,
    uploading a task's images with an uploader."""

    def __init__(self, session: CommandSession, uploader: ImageUploader):
        self.session = session
        self.uploader = uploader

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
        """Check everything locally, upload each image (only missing chunks), then queue the
        task (UPLINK_TASK) and wait for ACCEPTED. Running it again with the same input reuses
        the task id, so nothing is sent twice and no second task is queued."""
        prompt = check_prompt(prompt)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        priority = check_priority(priority)
        if task_id is not None:
            task_id = check_operator_name(task_id, "task id")
        images = prepare_images(list(image_paths))
        check_chunk_bytes(self.session.chunk_bytes, max(i.size for i in images))
        content = {
            "prompt": prompt,
            "images": [i.name for i in images],
            "max_new_tokens": max_new_tokens,
            "priority": priority,
        }
        reused = False
        if task_id is None and not new_task:
            same = self.session.state.find_same_task(content)
            if same is not None:
                task_id, reused = same["task_id"], True
                self.session.notify(
                    f"same task as {task_id} (state {same.get('state')}); re-sending it is harmless. "
                    "For a second run of it pass --new-task"
                )
        if task_id is None:
            known = {t["task_id"] for t in self.session.state.tasks()}
            task_id = new_task_id()
            while task_id in known:
                task_id = new_task_id()
        else:
            earlier = self.session.state.task(task_id)
            if (
                earlier is not None
                and earlier.get("state") != "rejected"
                and any(earlier.get(k) != v for k, v in content.items())
            ):
                raise LocalInputError(
                    f"task id {task_id} was already uplinked with other content (see `ow ground results`); "
                    "choose another id"
                )
        self.session.state.update_task(
            task_id,
            **content,
            image_files=[os.path.abspath(i.path) for i in images],
            station=self.session.station,
            chunk_bytes=self.session.chunk_bytes,
            state=(self.session.state.task(task_id) or {}).get("state", "uploading") if reused else "uploading",
        )
        uploads = [self.uploader.upload_image(image) for image in images]
        request = self.queue_task(task_id, prompt, [i.name for i in images], max_new_tokens, priority)
        return UplinkResult(task_id=task_id, request=request_dict(request), reused_task_id=reused, images=uploads)

    def queue_task(
        self, task_id: str, prompt: str, images: list[str], max_new_tokens: int, priority: int
    ) -> RequestRef:
        """UPLINK_TASK, sent again while unanswered (idempotent on the payload); the request
        ids are kept with the task so that its later reports can be recognised."""
        message = m.UplinkTask(
            task_id=task_id, prompt=prompt, images=tuple(images), max_new_tokens=max_new_tokens, priority=priority
        )

        def remember(ref: RequestRef) -> None:
            self.session.arrivals.task_requests[ref] = task_id
            self.session.state.update_task(task_id, add_request=request_dict(ref))

        try:
            ref, _ = self.session.transact(message, f"task {task_id}", retries=self.session.retries, on_send=remember)
        except CommandRejected as exc:
            self.session.state.update_task(task_id, state="rejected", code=exc.code.name, reason=exc.reason)
            raise
        except NoAnswer:
            self.session.state.update_task(task_id, state="unconfirmed")
            raise
        task = self.session.state.task(task_id) or {}
        if task.get("state") not in FINAL_TASK_STATES:
            self.session.state.update_task(task_id, state="accepted", request=request_dict(ref))
        else:
            self.session.state.update_task(task_id, request=request_dict(ref))
        return ref

    def track_task(self, task_id: str) -> None:
        task = self.session.state.task(task_id)
        for d in (task or {}).get("requests", []):
            try:
                self.session.arrivals.task_requests[request_from_dict(d)] = task_id
            except (KeyError, TypeError):
                continue

    def resend(self, task_id: str) -> UplinkResult:
        """Upload a known task's images again where the payload lacks them (one found damaged on
        board, IMAGE_CORRUPT) and send its UPLINK_TASK again (idempotent on the payload)."""
        task_id = check_operator_name(task_id, "task id")
        known = self.session.state.task(task_id)
        if known is None or not known.get("image_files"):
            raise LocalInputError(f"task {task_id} was not uplinked from this station (no image files recorded)")
        return self.uplink(
            known["image_files"],
            known["prompt"],
            max_new_tokens=known["max_new_tokens"],
            priority=known.get("priority", 0),
            task_id=task_id,
        )

    def cancel(self, task_id: str) -> None:
        """CANCEL_TASK -> ACCEPTED + COMPLETED (the task itself then ends FAILED(CANCELLED))."""
        task_id = check_operator_name(task_id, "task id")
        self.session.transact(m.CancelTask(task_id=task_id), f"CANCEL_TASK {task_id}", completion=True)
        if self.session.state.task(task_id) is not None:
            self.session.state.update_task(task_id, cancel_requested=True)

    def set_priority(self, task_id: str, priority: int) -> None:
        task_id = check_operator_name(task_id, "task id")
        priority = check_priority(priority)
        self.session.transact(
            m.SetPriority(task_id=task_id, priority=priority), f"SET_PRIORITY {task_id}", completion=True
        )
        if self.session.state.task(task_id) is not None:
            self.session.state.update_task(task_id, priority=priority)

    def tasks(self) -> list[dict]:
        """Tasks this station uplinked (local state), oldest first."""
        return self.session.state.tasks()
