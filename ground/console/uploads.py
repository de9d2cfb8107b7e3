"""The console's resumable uploads from the browser (docs/ground.md "Upload to the console").

An upload is named by its content's SHA-256 and kept under the station's state, in
`console-uploads/<sha256>/`:

    data          the bytes received, up to the acknowledged offset (anything past it is a chunk
                  whose acknowledgement never went out: cut off when the next chunk is written)
    upload.json   {"format": 1, "size", "offset", "complete"}, rewritten atomically after the
                  chunk's bytes are fsynced: the offset the console answers is always on disk
    named/<name>  a hard link to `data` under each name an uplink used: the path the task list
                  records (so `resend` finds the file) and the name the CLI's messages show

A chunk is kept only when all of it arrived and its SHA-256 matches; a file whose whole SHA-256
is not its name is dropped. Every call takes the upload's lock, so two pages sending the same
file cannot interleave their chunks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from pathlib import Path

from common.durable import DurableFS
from common.wire.ids import MAX_IMAGE_BYTES

#: the largest chunk one PUT may carry (the page sends 256 KiB)
MAX_CHUNK_BYTES = 4 * 1024 * 1024
#: an unfinished upload untouched this long is removed when the console starts
STALE_AFTER_S = 7 * 24 * 3600
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FORMAT = 1


class UploadError(Exception):
    """An upload request refused: the HTTP status, the message, and where the upload stands."""

    def __init__(self, status: int, message: str, offset: int | None = None):
        super().__init__(message)
        self.status, self.message, self.offset = status, message, offset


def check_upload_name(name: object) -> str:
    """The file's name as the operator chose it: a name, no folder (the browser sends none)."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or len(name.encode("utf-8", "surrogatepass")) > 255
    ):
        raise UploadError(400, f"image name {name!r}: not a file name (a name of 1..255 bytes, without a folder)")
    return name


class UploadStore:
    def __init__(self, root: str | os.PathLike, fs: DurableFS | None = None):
        self.root = Path(root)
        self.fs = fs or DurableFS()
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    # --- layout ----------------------------------------------------------------------------------
    def _folder(self, upload: str) -> Path:
        if not isinstance(upload, str) or not _SHA256.match(upload):
            raise UploadError(400, f"upload {upload!r}: not a SHA-256 (64 lowercase hex digits)")
        return self.root / upload

    def _lock(self, upload: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(upload, threading.Lock())

    def _meta(self, folder: Path) -> dict | None:
        """The upload's record, or None when there is none (a damaged one is dropped whole: the
        offset it held cannot be trusted)."""
        try:
            meta = json.loads((folder / "upload.json").read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            meta = None
        fields_ok = isinstance(meta, dict) and all(
            isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool) for k in ("size", "offset")
        )
        if not fields_ok or not 0 <= meta["offset"] <= meta["size"]:  # type: ignore[index]
            shutil.rmtree(folder, ignore_errors=True)
            return None
        return meta

    def _save(self, folder: Path, size: int, offset: int, complete: bool) -> dict:
        meta = {"format": _FORMAT, "size": size, "offset": offset, "complete": complete}
        self.fs.write_atomic(str(folder / "upload.json"), [json.dumps(meta).encode()])
        return meta

    @staticmethod
    def _answer(upload: str, meta: dict) -> dict:
        return {
            "upload": upload,
            "offset": meta["offset"],
            "size": meta["size"],
            "complete": bool(meta.get("complete")),
            "chunk_limit": MAX_CHUNK_BYTES,
        }

    # --- the protocol ------------------------------------------------------------------------------
    def create(self, name: object, size: object, upload: object) -> dict:
        """POST /api/uploads: make the upload, or say where an existing one stands."""
        shown = check_upload_name(name)
        folder = self._folder(upload)  # type: ignore[arg-type]
        if not isinstance(size, int) or isinstance(size, bool):
            raise UploadError(400, f"image {shown!r}: size {size!r} is not a whole number of bytes")
        if size < 1:
            raise UploadError(400, f"image {shown!r}: empty file")
        if size > MAX_IMAGE_BYTES:
            raise UploadError(
                400, f"image {shown!r}: {size} bytes, larger than the payload limit of {MAX_IMAGE_BYTES} bytes (16 MiB)"
            )
        assert isinstance(upload, str)
        with self._lock(upload):
            meta = self._meta(folder)
            if meta is not None and meta["size"] != size:
                raise UploadError(409, f"upload {upload} holds a file of {meta['size']} bytes, not {size}")
            if meta is None:
                folder.mkdir(parents=True, exist_ok=True)
                meta = self._save(folder, size, 0, False)
            return self._answer(upload, meta)

    def write(self, upload: str, offset: int, data: bytes, chunk_sha256: str) -> dict:
        """PUT /api/uploads/<sha256>: keep one chunk at `offset`, durable before it is answered."""
        folder = self._folder(upload)
        with self._lock(upload):
            meta = self._meta(folder)
            if meta is None:
                raise UploadError(404, f"no upload {upload}: create it first (POST /api/uploads)")
            stands_at = meta["offset"]
            if offset != meta["offset"]:
                stands = meta["offset"]
                raise UploadError(409, f"upload {upload} is at byte {stands}, not {offset}: go on from there", stands)
            if meta.get("complete"):
                raise UploadError(409, f"upload {upload} is complete", meta["offset"])
            if not data:
                raise UploadError(400, "an empty chunk")
            if len(data) > MAX_CHUNK_BYTES:  # (a body without Content-Length is measured only here)
                raise UploadError(413, f"a chunk of {len(data)} bytes: at most {MAX_CHUNK_BYTES}", stands_at)
            if offset + len(data) > meta["size"]:
                raise UploadError(400, f"the chunk ends at byte {offset + len(data)}, past the file's {meta['size']}")
            if hashlib.sha256(data).hexdigest() != chunk_sha256:
                why = f"the chunk at byte {offset} is not the one sent (SHA-256 differs)"
                raise UploadError(400, f"{why}: nothing kept, send it again")
            fd = os.open(folder / "data", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, offset)  # bytes past the acknowledged offset were never acknowledged
                os.pwrite(fd, data, offset)
                os.fsync(fd)
            finally:
                os.close(fd)
            end = offset + len(data)
            if end == meta["size"]:
                if _file_sha256(folder / "data") != upload:
                    shutil.rmtree(folder, ignore_errors=True)
                    why = "the file received is not the one announced (SHA-256 differs)"
                    raise UploadError(422, f"{why}: upload {upload} dropped; send it again")
                return self._answer(upload, self._save(folder, meta["size"], end, True))
            return self._answer(upload, self._save(folder, meta["size"], end, False))

    def path(self, upload: object, name: object) -> str:
        """The completed upload as a file called `name` (named/<name>, a hard link to its data):
        what the uplink's checks and the task list see."""
        shown = check_upload_name(name)
        folder = self._folder(upload)  # type: ignore[arg-type]
        assert isinstance(upload, str)
        with self._lock(upload):
            meta = self._meta(folder)
            if meta is None:
                raise UploadError(400, f"image {shown!r}: not uploaded to the console (no upload {upload})")
            if not meta.get("complete"):
                raise UploadError(
                    400, f"image {shown!r}: not uploaded to the console yet ({meta['offset']} of {meta['size']} bytes)"
                )
            named = folder / "named" / shown
            if not named.exists():
                named.parent.mkdir(exist_ok=True)
                try:
                    os.link(folder / "data", named)
                except OSError:  # a file system without hard links: a copy does
                    shutil.copyfile(folder / "data", named)
            return str(named)

    def adopt(self, source: str, name: str) -> str:
        """A file that arrived whole (the multipart form), checked already: into the store, as
        if uploaded in chunks; returns its named path."""
        upload = _file_sha256(Path(source))
        folder = self._folder(upload)
        with self._lock(upload):
            meta = self._meta(folder)
            if meta is None or not meta.get("complete"):
                folder.mkdir(parents=True, exist_ok=True)
                incoming = folder / f".incoming-{secrets.token_hex(4)}"
                shutil.copyfile(source, incoming)
                with open(incoming, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(incoming, folder / "data")
                size = (folder / "data").stat().st_size
                self._save(folder, size, size, True)
        return self.path(upload, name)

    def sweep(self, now: float | None = None) -> list[str]:
        """Remove the unfinished uploads untouched for STALE_AFTER_S (at console start)."""
        now = time.time() if now is None else now
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for folder in self.root.iterdir():
                if not _SHA256.match(folder.name):
                    continue
                meta = self._meta(folder)
                if meta is None or meta.get("complete"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if now - (folder / "upload.json").stat().st_mtime > STALE_AFTER_S:
                        shutil.rmtree(folder, ignore_errors=True)
                        removed.append(folder.name)
        return removed


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
