"""Image store: chunked uploads that survive power cuts, verified before use.

Each image has a directory `images/<name>/` holding `meta` (size, chunk count, SHA-256; written
with the first chunk), one file per received chunk `c<index>` (atomic writes), and, once every
chunk is present and the assembled file matches its SHA-256 and decodes as a picture, the file
`image`. Its presence means "verified"; chunks are then removed. A chunk already held is
accepted again (idempotent); one that disagrees with what is held is a CHUNK_CONFLICT.

A cut after the last chunk is stored but before `image` is committed leaves every chunk held and
nothing verified. Nothing new would arrive to finish it (the ground has sent every chunk), so a
query or a re-sent chunk that finds every chunk held assembles and verifies the file then.

The checks when the file is complete are the ones a task would otherwise fail on later
(common.imagecheck): pixel count, decode budget and aspect ratio from the header, then a decode
no larger than the model needs. `meta` stays beside the verified file: every use of the image
(`read_verified`) checks its SHA-256 again, and a file that no longer matches is removed with its
meta (ImageCorrupt), so that IMAGE_QUERY reports it missing and the ground sends it again.
"""

from __future__ import annotations

import hashlib
import os
import threading

import msgpack

from common.durable import DurableFS, best_effort
from common.imagecheck import ImageRejected, ProcessorLimits, open_reduced
from common.wire import ResponseCode, WireError
from common.wire import messages as m


class ImageCorrupt(Exception):
    """A verified image no longer matches its SHA-256 (or lost its meta): it was removed."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"image {name}: {reason}")
        self.name, self.reason = name, reason


class ImageStore:
    def __init__(self, directory: str, fs: DurableFS | None = None, limits: ProcessorLimits | None = None):
        self.fs = fs or DurableFS()
        self.directory = directory
        best_effort(self.fs.makedirs, directory)  # a read-only disk: uploads are refused, not the boot
        self._lock = threading.Lock()
        #: the model's image-processor limits a completed upload is checked against (None: the
        #: defaults). Read by the main thread as an upload completes, under `_lock`; the worker
        #: thread sets them once it finds a model that was missing at boot (`set_limits`).
        self._limits = limits

    def set_limits(self, limits: ProcessorLimits) -> None:
        """The model's limits, for every upload completed from now on (any thread). Swapped under
        the store's lock: an upload being verified on the main thread keeps the limits it started
        with, and the next one sees the new ones (ProcessorLimits is frozen: the value is never
        changed, only replaced)."""
        with self._lock:
            self._limits = limits

    def _dir(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def image_path(self, name: str) -> str:
        return os.path.join(self._dir(name), "image")

    def is_verified(self, name: str) -> bool:
        return self.fs.exists(self.image_path(name))

    def _meta(self, name: str) -> dict | None:
        p = os.path.join(self._dir(name), "meta")
        if not self.fs.exists(p):
            return None
        try:
            return msgpack.unpackb(bytes(self.fs.read(p)), raw=False)
        except Exception:  # a torn meta file: treat as absent (it is rewritten by the next chunk)
            return None

    def _held(self, name: str) -> list[int]:
        return sorted(int(n[1:]) for n in self.fs.listdir(self._dir(name)) if n.startswith("c") and n[1:].isdigit())

    def status(self, name: str) -> m.ImageStatus:
        with self._lock:
            if self.is_verified(name):
                verified = self._meta(name) or {}
                total = int(verified.get("total", 1))
                return m.ImageStatus.of(
                    name,
                    int(verified.get("size", self.fs.size(self.image_path(name)))),
                    total,
                    range(total),
                    verified=True,
                )
            meta = self._meta(name)
            if meta is None:
                return m.ImageStatus.of(name, 0, 0, [], verified=False)
            return m.ImageStatus.of(name, meta["size"], meta["total"], self._held(name), verified=False)

    def complete_held(self, name: str) -> int | None:
        """Finish an upload that a cut left with every chunk held and no file committed; returns
        the image's size when this call verified it, else None (nothing to finish). Raises
        WireError, having dropped the chunks, when the assembled file fails its checks."""
        with self._lock:
            if self.is_verified(name):
                return None
            meta = self._meta(name)
            if meta is None or len(self._held(name)) < meta["total"]:
                return None
            self._assemble(name, meta)
            return int(meta["size"])

    def put_chunk(self, chunk: m.ImageChunk) -> bool:
        """Store a chunk; returns True when this chunk completed and verified the image.
        Raises WireError (CHUNK_CONFLICT, FILE_HASH_MISMATCH, IMAGE_UNDECODABLE)."""
        name = chunk.image
        with self._lock:
            if self.is_verified(name):
                verified = self._meta(name) or {}
                if verified.get("sha256") not in (None, bytes(chunk.sha256)):
                    raise WireError(ResponseCode.CHUNK_CONFLICT, f"image {name} already verified with other content")
                return False
            d = self._dir(name)
            self.fs.makedirs(d)
            meta = self._meta(name)
            mine = {"size": chunk.image_size, "total": chunk.total, "sha256": bytes(chunk.sha256)}
            if meta is None:
                self.fs.write_atomic(os.path.join(d, "meta"), [msgpack.packb(mine, use_bin_type=True)])
            elif meta != mine:
                raise WireError(
                    ResponseCode.CHUNK_CONFLICT,
                    f"image {name}: chunk declares size/count/hash other than earlier chunks",
                )
            path = os.path.join(d, f"c{chunk.index}")
            if self.fs.exists(path):
                if bytes(self.fs.read(path)) != bytes(chunk.data):
                    raise WireError(
                        ResponseCode.CHUNK_CONFLICT, f"image {name}: chunk {chunk.index} differs from the one held"
                    )
                if len(self._held(name)) < chunk.total:
                    return False
                return self._assemble(name, mine)  # every chunk was held, the file never committed
            self.fs.write_atomic(path, [bytes(chunk.data)])
            if len(self._held(name)) < chunk.total:
                return False
            return self._assemble(name, mine)

    def _assemble(self, name: str, meta: dict) -> bool:
        # called with `_lock` held (put_chunk, complete_held): it reads `_limits`
        d = self._dir(name)
        content = b"".join(bytes(self.fs.read(os.path.join(d, f"c{i}"))) for i in range(meta["total"]))
        try:
            if len(content) != meta["size"]:
                raise WireError(
                    ResponseCode.FILE_HASH_MISMATCH, f"{name}: assembled {len(content)} bytes, declared {meta['size']}"
                )
            m.check_file_hash(content, meta["sha256"], name)
            _check_picture(name, content, self._limits)
        except WireError:
            self._drop_chunks(name, keep_meta=False)  # let the ground send a correct file again
            raise
        self.fs.write_atomic(self.image_path(name), [content])
        self._drop_chunks(name, keep_meta=True)
        return True

    def read_verified(self, name: str) -> bytes:
        """The verified image's bytes, checked against the SHA-256 it was uploaded with. A
        mismatch (storage damage) removes the image, so that the ground can send it again, and
        raises ImageCorrupt."""
        with self._lock:
            meta = self._meta(name)
            try:
                content = bytes(self.fs.read(self.image_path(name)))
            except OSError as exc:
                reason = f"unreadable ({type(exc).__name__})"
            else:
                if meta is None or "sha256" not in meta:
                    reason = "its SHA-256 record is missing or damaged"
                elif hashlib.sha256(content).digest() != bytes(meta["sha256"]):
                    reason = (
                        f"{len(content)} bytes on board no longer match the SHA-256 they were uploaded with "
                        f"({bytes(meta['sha256']).hex()[:16]}...)"
                    )
                else:
                    return content
            self.drop(name)
        raise ImageCorrupt(name, reason)

    def drop(self, name: str) -> None:
        """Forget an image entirely (file, meta, chunks): the ground's next upload sends it anew."""
        d = self._dir(name)
        for n in self.fs.listdir(d):
            self.fs.remove(os.path.join(d, n), sync=False)
        if os.path.isdir(d):
            self.fs.fsync_dir(d)

    def _drop_chunks(self, name: str, keep_meta: bool) -> None:
        d = self._dir(name)
        for n in self.fs.listdir(d):
            if (n.startswith("c") and n[1:].isdigit()) or (n == "meta" and not keep_meta):
                self.fs.remove(os.path.join(d, n), sync=False)
        self.fs.remove_stale_temps(d)  # chunks whose write a cut interrupted
        self.fs.fsync_dir(d)

    def bytes_held(self) -> int:
        total = 0
        for root, _, files in os.walk(self.directory):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total


class AwaitedImages:
    """Tasks waiting for the ground to send a damaged image again: task id -> image name. The
    worker notes and clears them, the command thread reads them for DOWNLINK_RESULT's answer;
    behind a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_task: dict[str, str] = {}

    def note(self, task_id: str, image: str) -> None:
        with self._lock:
            self._by_task[task_id] = image

    def clear(self, task_id: str) -> None:
        with self._lock:
            self._by_task.pop(task_id, None)

    def get(self, task_id: str) -> str | None:
        with self._lock:
            return self._by_task.get(task_id)


def _check_picture(name: str, content: bytes, limits: ProcessorLimits | None) -> None:
    """Everything a task would later fail on, checked now: header limits, shape, decodability."""
    try:
        open_reduced(content, name, limits or ProcessorLimits())
    except ImageRejected as exc:
        raise WireError(exc.code, str(exc)) from None


def content_hash(prompt: str, images: list[str], max_new_tokens: int) -> str:
    h = hashlib.sha256()
    h.update(msgpack.packb([prompt, list(images), int(max_new_tokens)], use_bin_type=True))
    return h.hexdigest()
