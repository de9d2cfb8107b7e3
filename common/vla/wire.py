"""Wire format of the openpi websocket policy protocol, and LIBERO-style observation parsing.

openpi-client ships its own `msgpack_numpy` module (adapted from lebedov's msgpack-numpy, but
with different map keys and no pickle fallback): an ndarray travels as the map
    {b"__ndarray__": True, b"data": <raw bytes>, b"dtype": dtype.str, b"shape": shape}
and a numpy scalar as {b"__npgeneric__": True, b"data": item, b"dtype": dtype.str}. The PyPI
`msgpack-numpy` package uses other keys (b"nd", b"type", b"kind") and unpickles object arrays, so
it can neither read openpi messages nor be trusted with a robot's bytes; this module implements
openpi's encoding exactly and refuses object, void and complex dtypes as openpi's packer does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import numpy as np

from common.vla.models import Observation

IMAGE_KEYS = ("observation/image", "observation/wrist_image")
STATE_KEY = "observation/state"
PROMPT_KEY = "prompt"
IMAGE_SIZE = 224
STATE_DIM = 8
MAX_PROMPT_CHARS = 1000
_REFUSED_KINDS = ("V", "O", "c")


class RequestError(ValueError):
    """A robot sent something the endpoint cannot serve; the message goes back to the robot."""


def pack_array(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in _REFUSED_KINDS:
        raise ValueError(f"Unsupported dtype: {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _dtype(code) -> np.dtype:
    try:
        dt = np.dtype(code.decode() if isinstance(code, bytes) else code)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"bad array dtype {code!r}") from exc
    if dt.kind in _REFUSED_KINDS:
        raise RequestError(f"array dtype {dt} is not accepted")
    return dt


def unpack_array(obj: dict):
    if b"__ndarray__" in obj:
        dt = _dtype(obj.get(b"dtype"))
        shape, data = obj.get(b"shape"), obj.get(b"data")
        if (
            not isinstance(data, bytes)
            or not isinstance(shape, (list, tuple))
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise RequestError("malformed array: needs bytes data and a non-negative integer shape")
        if math.prod(shape) * dt.itemsize != len(data):
            raise RequestError(f"malformed array: {len(data)} bytes do not hold shape {tuple(shape)} of {dt}")
        return np.ndarray(buffer=data, dtype=dt, shape=tuple(shape))
    if b"__npgeneric__" in obj:
        return _dtype(obj.get(b"dtype")).type(obj.get(b"data"))
    return obj


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=pack_array)


def unpackb(data: bytes):
    """Decode one message; any decoding problem becomes a RequestError."""
    try:
        return msgpack.unpackb(data, object_hook=unpack_array)
    except RequestError:
        raise
    except Exception as exc:  # msgpack raises several types for truncated or invalid input
        raise RequestError(f"message is not valid msgpack: {type(exc).__name__}: {exc}") from None


def _image(key: str, value) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise RequestError(f"{key!r} must be an image array, got {type(value).__name__}")
    img = value
    if img.ndim == 3 and img.shape[0] == 3 and img.shape[-1] != 3:  # CHW -> HWC, as openpi's LIBERO inputs do
        img = np.transpose(img, (1, 2, 0))
    if img.shape != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise RequestError(f"{key!r} must be {IMAGE_SIZE}x{IMAGE_SIZE}x3 (HWC or CHW), got shape {value.shape}")
    if np.issubdtype(img.dtype, np.floating):  # openpi convention: float images are in [0, 1]
        if not np.isfinite(img).all():
            raise RequestError(f"{key!r} has non-finite pixels")
        img = (255 * np.clip(img, 0.0, 1.0)).astype(np.uint8)
    elif img.dtype != np.uint8:
        raise RequestError(f"{key!r} must be uint8 or float, got {img.dtype}")
    return img


def parse_observation(obj, noise_seed: int = 0) -> Observation:
    """A LIBERO-style observation: two 224x224 RGB images, an 8-d state and a prompt."""
    if not isinstance(obj, dict):
        raise RequestError(f"observation must be a map, got {type(obj).__name__}")
    missing = [k for k in (*IMAGE_KEYS, STATE_KEY, PROMPT_KEY) if k not in obj]
    if missing:
        raise RequestError(f"observation is missing {', '.join(map(repr, missing))}")
    images = [_image(k, obj[k]) for k in IMAGE_KEYS]
    try:
        state = np.asarray(obj[STATE_KEY], dtype=np.float32)
    except (TypeError, ValueError):
        raise RequestError(f"{STATE_KEY!r} must be {STATE_DIM} numbers") from None
    if state.shape != (STATE_DIM,) or not np.isfinite(state).all():
        raise RequestError(f"{STATE_KEY!r} must be {STATE_DIM} finite numbers, got shape {state.shape}")
    prompt = obj[PROMPT_KEY]
    if isinstance(prompt, bytes):
        prompt = prompt.decode("utf-8", errors="replace")
    if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
        raise RequestError(f"{PROMPT_KEY!r} must be a string of at most {MAX_PROMPT_CHARS} characters")
    return Observation(images, state, prompt, noise_seed)


@dataclass(frozen=True)
class ServerTiming:
    infer_ms: float
    vlm_done_ms: float
    total_ms: float
    prev_total_ms: float | None

    def to_wire(self) -> dict:
        d = {"infer_ms": self.infer_ms, "vlm_done_ms": self.vlm_done_ms, "server_total_ms": self.total_ms}
        if self.prev_total_ms is not None:
            d["prev_total_ms"] = self.prev_total_ms
        return d
