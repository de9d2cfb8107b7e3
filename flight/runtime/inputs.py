"""A task's model inputs on board: built once from its verified images (tokenizer, image
processor) and stored beside its checkpoints (TASK_INPUTS + TASK_PIXELS, docs/record-format.md),
read back at every later start, so a resumed task needs no tokenizer, image processor or PIL
before its last step. Worker thread.

An image found damaged when it is needed is removed and awaited again (IMAGE_CORRUPT): the
task waits for the ground to send it, as a task that has not started does. Found before the
engine runs, the worker does not start it; found when the engine asks for the pixel patches
(a resumed task whose stored ones are damaged), the loader answers None and the engine ends the
run with the status AWAITING_INPUTS (flight/events.py).
"""

from __future__ import annotations

from typing import Any

from common.durable import DurableFS
from common.wire import EventId, ResponseCode
from flight.model.config import processors_hash

from .config import DataPaths
from .images import AwaitedImages, ImageCorrupt, ImageStore
from .outbox import Outbox
from .storage import Storage


class TaskInputs:
    """Reads, builds and stores a task's inputs (worker thread)."""

    def __init__(
        self,
        *,
        paths: DataPaths,
        fs: DurableFS,
        growth_fs: DurableFS,
        images: ImageStore,
        awaited_images: AwaitedImages,
        storage: Storage,
        outbox: Outbox,
        log: Any,
    ):
        self.paths = paths
        self.fs = fs
        self.growth_fs = growth_fs  # growth, like a checkpoint: gated while the disk is degraded
        self.images = images
        self.awaited_images = awaited_images
        self.storage = storage
        self.outbox = outbox
        self.log = log

    def key(self, task: Any, model: Any) -> dict:
        return {"task": task.content_hash, "model": model.content_hash, "processors": processors_hash(model.model_dir)}

    def stored(self, task: Any, model: Any):
        """The task's preprocessed inputs as stored at its first start (TASK_INPUTS,
        docs/record-format.md), or None -- a resumed task needs no tokenizer, image processor or
        PIL before its last step."""
        # lazy: torch/transformers (seconds): the payload answers the bus first (0.5 s budget)
        from flight.model.inputs import load_inputs

        inputs, why = load_inputs(
            self.fs,
            self.paths.inputs_path(task.task_id),
            self.key(task, model),
            rebuild_pixels=lambda reason: self._rebuilt_pixels(task, model, reason),
        )
        if why is not None:
            self.log.warning("task_inputs_rebuilt", task_id=task.task_id, reason=why)
        return inputs

    def _rebuilt_pixels(self, task: Any, model: Any, reason: str):
        """The pixel patches of a task whose stored ones cannot be used (asked for only when its
        vision phase runs from them), built again from its verified images and stored again;
        None (the engine ends the run AWAITING_INPUTS, the task waits for the ground) if an
        image no longer matches."""
        self.log.warning("task_pixels_rebuilt", task_id=task.task_id, reason=reason)
        contents = self.images_of(task)
        if contents is None:
            return None
        return self.build(task, model, contents).pixel_values

    def images_of(self, task: Any) -> list[bytes] | None:
        """The task's images, each checked against its SHA-256; None (the task waits for the
        ground to send a damaged one again) if one no longer matches."""
        contents = []
        for name in task.images:
            try:
                contents.append(self.images.read_verified(name))
            except ImageCorrupt as exc:
                self.awaited_images.note(task.task_id, name)
                self.outbox.event(
                    EventId.IMAGE_CORRUPT,
                    f"task {task.task_id} waits: image {name} {exc.reason}; removed, "
                    f"the ground must send it again ({ResponseCode.IMAGE_CORRUPT.name})",
                    task.task_id,
                )
                return None
        self.awaited_images.clear(task.task_id)
        return contents

    def build(self, task: Any, model: Any, contents: list[bytes]):
        """Tokenize and process the task's verified images once, and store the result."""
        # lazy: torch/transformers (seconds): the payload answers the bus first (0.5 s budget)
        from flight.model.inputs import build_inputs, decode_image, save_inputs

        images = [
            decode_image(content, name, model.image_processor)
            for name, content in zip(task.images, contents, strict=True)
        ]
        inputs = build_inputs(model.tokenizer, model.image_processor, images, task.prompt, model.adapter.image_token_id)
        del images
        task_dir = self.paths.task_dir(task.task_id)
        try:
            self.fs.makedirs(task_dir)
            # A cut during an earlier try at this write left its temporary: without this, each
            # cut before the inputs are durable would leave one more on the disk.
            self.fs.remove_stale_temps(task_dir)
            # Growth, like a checkpoint: through the gate that keeps it out of a degraded disk.
            save_inputs(self.growth_fs, self.paths.inputs_path(task.task_id), inputs, self.key(task, model))
        except OSError as exc:  # a full or read-only disk costs the shortcut, not the task
            if not self.storage.failed(exc, f"storing the inputs of task {task.task_id}"):
                raise
            self.log.warning("task_inputs_not_stored", task_id=task.task_id, reason=str(exc.strerror))
        return inputs


__all__ = ["TaskInputs"]
