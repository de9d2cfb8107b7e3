"""Local checks of everything the operator hands to `uplink`, before a single packet is sent.

A bad file or prompt is refused here (exit 5) rather than by the payload after minutes of
uplink: the payload runs the same checks again, but the operator learns sooner and the link
time is not wasted.
"""

from __future__ import annotations

import hashlib
import io
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from common.imagecheck import ImageRejected, plan
from common.wire import WireError
from common.wire import messages as m
from common.wire.fields import check_name
from common.wire.ids import (
    DEFAULT_CHUNK_DATA_BYTES,
    MAX_CHUNK_DATA_BYTES,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_CHUNKS,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_TASK,
    MAX_NAME_CHARS,
    MAX_NEW_TOKENS,
    MAX_PRIORITY,
    MAX_PROMPT_BYTES,
)
from common.wire.rules import prompt_rule
from ground.errors import LocalInputError

#: Hex digits of the content hash in an image's on-board name: 64 bits, so two different files
#: never share a name by accident, and the same file always gets the same name (resume, reuse).
NAME_HASH_HEX = 16
_STEM_CHARS = 32
# Same pixel budget as the payload's decoder check: larger would be refused on board.
MAX_PIXELS = MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class PreparedImage:
    """A validated image file, ready to be cut into IMAGE_CHUNKs."""

    path: str
    name: str
    content: bytes = field(repr=False)
    sha256: bytes
    format: str
    width: int
    height: int

    @property
    def size(self) -> int:
        return len(self.content)

    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_DATA_BYTES) -> list[m.ImageChunk]:
        return m.ImageChunk.split(self.name, self.content, chunk_bytes)


def safe_image_name(path: str, sha256: bytes, image_format: str) -> str:
    """`<stem>-<hash>.<ext>`: the file's stem reduced to [A-Za-z0-9_-] (so nothing path-like
    can survive), a content hash, and the picture format. Never derived from the path alone:
    two files called `a.png` in different folders are different images on board."""
    stem = Path(path).stem
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", stem)
    stem = re.sub(r"^[^A-Za-z0-9]+", "", stem)[:_STEM_CHARS].rstrip("_-") or "image"
    ext = {"jpeg": "jpg"}.get(image_format.lower(), image_format.lower())
    ext = re.sub(r"[^a-z0-9]", "", ext)[:5] or "img"
    name = f"{stem}-{sha256.hex()[:NAME_HASH_HEX]}.{ext}"
    assert len(name) <= MAX_NAME_CHARS
    return check_name(name, "image name")


def prepare_image(path: str) -> PreparedImage:
    """Read and check one image file: exists, is a regular file, 1 byte .. 16 MiB, decodes as a
    picture. Raises LocalInputError with a one-line reason."""
    p = Path(path)
    shown = repr(str(path))
    try:
        st = p.stat()
    except FileNotFoundError:
        raise LocalInputError(f"image {shown}: no such file") from None
    except OSError as exc:
        raise LocalInputError(f"image {shown}: {exc.strerror}") from None
    if not p.is_file():
        raise LocalInputError(f"image {shown}: not a regular file")
    if st.st_size == 0:
        raise LocalInputError(f"image {shown}: empty file")
    if st.st_size > MAX_IMAGE_BYTES:
        raise LocalInputError(
            f"image {shown}: {st.st_size} bytes, larger than the payload limit of {MAX_IMAGE_BYTES} bytes (16 MiB)"
        )
    try:
        content = p.read_bytes()
    except OSError as exc:
        raise LocalInputError(f"image {shown}: {exc.strerror}") from None
    if len(content) > MAX_IMAGE_BYTES or not content:  # changed under us
        raise LocalInputError(f"image {shown}: size changed while reading ({len(content)} bytes)")

    try:
        with Image.open(io.BytesIO(content)) as im:
            width, height, image_format = im.width, im.height, im.format or "img"
            plan(im, f"image {shown}", None)  # the payload's own header checks: pixels, decode budget, shape
            im.load()
    except ImageRejected as exc:
        raise LocalInputError(f"{exc} ({exc.code.name})") from None
    except Exception as exc:  # PIL raises many kinds for bad data (and DecompressionBombError)
        raise LocalInputError(f"image {shown}: not a decodable picture ({type(exc).__name__})") from None
    sha256 = hashlib.sha256(content).digest()
    return PreparedImage(
        path=str(path),
        name=safe_image_name(str(path), sha256, image_format),
        content=content,
        sha256=sha256,
        format=image_format,
        width=width,
        height=height,
    )


def check_prompt(prompt: str) -> str:
    """The prompt must be valid UTF-8 (argv bytes that were not arrive as surrogates), not blank,
    and at most MAX_PROMPT_BYTES encoded."""
    try:
        encoded = prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LocalInputError(f"prompt is not valid UTF-8 (undecodable byte at character {exc.start})") from None
    broken = prompt_rule(prompt)  # the payload's rule (common/wire/rules.py), checked before anything is sent
    if broken is not None:
        raise LocalInputError(f"{broken.reason} ({broken.code.name})")
    if len(encoded) > MAX_PROMPT_BYTES:
        raise LocalInputError(f"prompt is {len(encoded)} bytes of UTF-8, more than {MAX_PROMPT_BYTES}")
    return prompt


def check_operator_name(value: str, what: str) -> str:
    """A task id (or other name) typed by the operator: refused locally with the wire rule."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise LocalInputError(f"{what} is not valid UTF-8") from None
    try:
        return check_name(value, what)
    except WireError as exc:
        raise LocalInputError(f"{exc.code.name}: {exc.reason}") from None


def check_priority(priority: int) -> int:
    if not 0 <= priority <= MAX_PRIORITY:
        raise LocalInputError(f"priority {priority} outside 0..{MAX_PRIORITY}")
    return priority


def check_max_new_tokens(n: int) -> int:
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise LocalInputError(f"max new tokens {n} outside 1..{MAX_NEW_TOKENS}")
    return n


def check_chunk_bytes(chunk_bytes: int, largest_image: int = 0) -> int:
    if not 1 <= chunk_bytes <= MAX_CHUNK_DATA_BYTES:
        raise LocalInputError(f"chunk size {chunk_bytes} outside 1..{MAX_CHUNK_DATA_BYTES} bytes")
    if largest_image and -(-largest_image // chunk_bytes) > MAX_IMAGE_CHUNKS:
        raise LocalInputError(
            f"chunk size {chunk_bytes} cuts a {largest_image}-byte image into more than {MAX_IMAGE_CHUNKS} chunks"
        )
    return chunk_bytes


def prepare_images(paths: list[str]) -> list[PreparedImage]:
    if not paths:
        raise LocalInputError("at least one --image is needed")
    if len(paths) > MAX_IMAGES_PER_TASK:
        raise LocalInputError(f"{len(paths)} images; a task takes at most {MAX_IMAGES_PER_TASK}")
    images = [prepare_image(p) for p in paths]
    seen: dict[str, str] = {}
    for image in images:
        if image.name in seen:
            raise LocalInputError(
                f"images {seen[image.name]!r} and {image.path!r} have the same content; give each picture once"
            )
        seen[image.name] = image.path
    return images


def new_task_id() -> str:
    """Short, unique, not path-like: `t-` and 10 characters of base32 randomness (50 bits)."""
    alphabet = "abcdefghijkmnpqrstuvwxyz23456789"  # no l/o/0/1: read aloud over a voice loop
    return "t-" + "".join(secrets.choice(alphabet) for _ in range(10))
