"""Image store: chunked uploads that survive power cuts, verified before use.

Each image has a directory `images/<name>/` holding `meta` (size, chunk count, SHA-256; written
with the first chunk), one file per received chunk `c<index>` (atomic writes), and, once every
chunk is present and the assembled file matches its SHA-256 and decodes as a picture, the file
`image`. Its presence means "verified"; chunks are then removed. A chunk already held is
accepted again (idempotent); one that disagrees with what is held is a CHUNK_CONFLICT.

A cut after the last chunk is stored but before `image` is committed leaves every chunk held and
nothing verified. Nothing new would arrive to finish it (the ground has sent every chunk), so a
query or a re-sent chunk that finds every chunk held assembles and verifies the file then.
"""
from __future__ import annotations

import hashlib
import io
import os
import threading

import msgpack

from common.durable import DurableFS
from common.wire import ResponseCode, WireError
from common.wire import messages as m


class ImageStore:
    def __init__(self, directory: str, fs: DurableFS | None = None):
        self.fs = fs or DurableFS()
        self.directory = directory
        self.fs.makedirs(directory)
        self._lock = threading.Lock()

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
                meta = self._meta(name) or {}
                total = int(meta.get("total", 1))
                return m.ImageStatus.of(name, int(meta.get("size", self.fs.size(self.image_path(name)))), total,
                                        range(total), verified=True)
            meta = self._meta(name)
            if meta is None:
                return m.ImageStatus.of(name, 0, 0, [], verified=False)
            held = self._held(name)
            if len(held) == meta["total"]:
                try:
                    self._assemble(name, meta)
                    return m.ImageStatus.of(name, meta["size"], meta["total"], range(meta["total"]), verified=True)
                except WireError:
                    return m.ImageStatus.of(name, 0, 0, [], verified=False)  # dropped: the ground sends it again
            return m.ImageStatus.of(name, meta["size"], meta["total"], held, verified=False)

    def put_chunk(self, chunk: m.ImageChunk) -> bool:
        """Store a chunk; returns True when this chunk completed and verified the image.
        Raises WireError (CHUNK_CONFLICT, FILE_HASH_MISMATCH, IMAGE_UNDECODABLE)."""
        name = chunk.image
        with self._lock:
            if self.is_verified(name):
                meta = self._meta(name) or {}
                if meta.get("sha256") not in (None, bytes(chunk.sha256)):
                    raise WireError(ResponseCode.CHUNK_CONFLICT, f"image {name} already verified with other content")
                return False
            d = self._dir(name)
            self.fs.makedirs(d)
            meta = self._meta(name)
            mine = {"size": chunk.image_size, "total": chunk.total, "sha256": bytes(chunk.sha256)}
            if meta is None:
                self.fs.write_atomic(os.path.join(d, "meta"), [msgpack.packb(mine, use_bin_type=True)])
            elif meta != mine:
                raise WireError(ResponseCode.CHUNK_CONFLICT,
                                f"image {name}: chunk declares size/count/hash other than earlier chunks")
            path = os.path.join(d, f"c{chunk.index}")
            if self.fs.exists(path):
                if bytes(self.fs.read(path)) != bytes(chunk.data):
                    raise WireError(ResponseCode.CHUNK_CONFLICT, f"image {name}: chunk {chunk.index} differs from the one held")
                if len(self._held(name)) < chunk.total:
                    return False
                return self._assemble(name, mine)  # every chunk was held, the file never committed
            self.fs.write_atomic(path, [bytes(chunk.data)])
            if len(self._held(name)) < chunk.total:
                return False
            return self._assemble(name, mine)

    def _assemble(self, name: str, meta: dict) -> bool:
        d = self._dir(name)
        content = b"".join(bytes(self.fs.read(os.path.join(d, f"c{i}"))) for i in range(meta["total"]))
        try:
            if len(content) != meta["size"]:
                raise WireError(ResponseCode.FILE_HASH_MISMATCH, f"{name}: assembled {len(content)} bytes, declared {meta['size']}")
            m.check_file_hash(content, meta["sha256"], name)
            _check_picture(name, content)
        except WireError:
            self._drop_chunks(name, keep_meta=False)  # let the ground send a correct file again
            raise
        self.fs.write_atomic(self.image_path(name), [content])
        self._drop_chunks(name, keep_meta=True)
        return True

    def _drop_chunks(self, name: str, keep_meta: bool) -> None:
        d = self._dir(name)
        for n in self.fs.listdir(d):
            if (n.startswith("c") and n[1:].isdigit()) or (n == "meta" and not keep_meta):
                self.fs.remove(os.path.join(d, n), sync=False)
        self.fs.fsync_dir(d)

    def bytes_held(self) -> int:
        total = 0
        for root, _, files in os.walk(self.directory):
            total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total


def _check_picture(name: str, content: bytes) -> None:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(content)) as im:
            if im.width * im.height > 100_000_000:
                raise WireError(ResponseCode.IMAGE_TOO_LARGE, f"{name}: {im.width}x{im.height} pixels")
            im.load()
    except WireError:
        raise
    except Exception as exc:  # PIL raises many kinds for bad data
        raise WireError(ResponseCode.IMAGE_UNDECODABLE, f"{name}: not a decodable picture ({type(exc).__name__})") from None


def content_hash(prompt: str, images: list[str], max_new_tokens: int) -> str:
    h = hashlib.sha256()
    h.update(msgpack.packb([prompt, list(images), int(max_new_tokens)], use_bin_type=True))
    return h.hexdigest()
