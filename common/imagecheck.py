"""What a picture costs before it is decoded, and decoding it no larger than the model needs.

Shared by the ground (local checks before uplink), the payload's image store (checks when the
last chunk arrives) and the model's input builder (the decode itself), so that all three judge a
picture the same way (docs/flight.md "Images"):

- from the header alone: at most MAX_IMAGE_PIXELS pixels, an aspect ratio the Qwen-VL image
  processors take (MAX_ASPECT_RATIO), and a decode that fits MAX_DECODE_BYTES at the resolution
  it will be decoded at (JPEG decodes at 1/2, 1/4 or 1/8 scale when the model needs no more:
  PIL's `draft`; other formats decode at full size);
- decoding: after `draft`, an integer `reduce` brings the picture down to no less than the size
  the processor will resize it to, before it is converted to RGB. The processor then sees a
  picture at most about twice its target size instead of the upload's full resolution, and
  decodes run one at a time (`DECODE_LOCK`), so a task's image memory is bounded by one decode
  budget plus its images at model size.

`target_size` is the processor's own rule (transformers' Qwen2-VL `smart_resize`), restated here
so that the payload's command thread can apply it without importing transformers;
tests/flight/test_images_memory.py checks that the two agree.
"""

from __future__ import annotations

import io
import json
import math
import os
import threading
from dataclasses import dataclass

from common.wire.ids import MAX_ASPECT_RATIO, MAX_DECODE_BYTES, MAX_IMAGE_PIXELS, ResponseCode

#: One decode at a time in a process: the payload's command thread (checks at uplink) and its
#: worker (task inputs) never hold two full-resolution decodes at once.
DECODE_LOCK = threading.Lock()
#: Bytes per pixel PIL holds in memory, by mode (multi-band 8-bit modes use 32-bit pixels).
_PIXEL_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "LA": 4, "La": 4, "PA": 4}
#: Modes `reduce` works on directly; others are converted to RGB(A) at full size first.
_REDUCIBLE = {"L", "LA", "La", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "I", "F"}


class ImageRejected(ValueError):
    """A picture the payload will not take, with the response code saying why."""

    def __init__(self, code: ResponseCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ProcessorLimits:
    """The image processor's resizing rule: sides multiple of `factor` (patch x merge), total
    pixels within [min_pixels, max_pixels]."""

    factor: int = 28
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def of_processor(cls, processor) -> ProcessorLimits:
        size = getattr(processor, "size", None) or {}
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, d))
        return cls(
            int(processor.patch_size) * int(processor.merge_size),
            int(get("shortest_edge", cls.min_pixels)),
            int(get("longest_edge", cls.max_pixels)),
        )

    @classmethod
    def of_model_dir(cls, model_dir: str) -> ProcessorLimits:
        """From the model directory's preprocessor_config.json, without importing transformers."""

        try:
            with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            return cls()
        size = cfg.get("size") or {}
        return cls(
            int(cfg.get("patch_size", 14)) * int(cfg.get("merge_size", 2)),
            int(size.get("shortest_edge", cfg.get("min_pixels", cls.min_pixels))),
            int(size.get("longest_edge", cfg.get("max_pixels", cls.max_pixels))),
        )


def target_size(width: int, height: int, limits: ProcessorLimits) -> tuple[int, int]:
    """(width, height) the processor resizes a width x height picture to (smart_resize).
    Raises ImageRejected(IMAGE_SHAPE_UNSUPPORTED) where the processor would raise."""
    if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        raise ImageRejected(
            ResponseCode.IMAGE_SHAPE_UNSUPPORTED,
            f"{width}x{height} pixels: aspect ratio above {MAX_ASPECT_RATIO}, which the model's "
            "image processor cannot take",
        )
    factor = limits.factor
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > limits.max_pixels:
        beta = math.sqrt((height * width) / limits.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < limits.min_pixels:
        beta = math.sqrt(limits.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


def _pixel_bytes(mode: str) -> int:
    return _PIXEL_BYTES.get(mode, 4)


def decode_cost(im) -> int:
    """Peak bytes of decoding the (header-only) image `im` at its current (drafted) size and
    bringing it to RGB: the decode, plus a full-size RGB(A) copy when `reduce` cannot work on
    its mode."""
    pixels = im.width * im.height
    cost = pixels * _pixel_bytes(im.mode)
    if im.mode not in _REDUCIBLE:
        cost += pixels * 4
    return cost


def plan(im, name: str, limits: ProcessorLimits | None) -> tuple[int, int] | None:
    """Check an opened, not yet decoded picture from its header, and set up a JPEG's reduced
    decode. Returns the processor's target size (None without `limits`). Raises ImageRejected."""
    width, height = im.width, im.height
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ImageRejected(
            ResponseCode.IMAGE_TOO_LARGE,
            f"{name}: {width}x{height} pixels, more than the payload decodes ({MAX_IMAGE_PIXELS})",
        )
    target = None
    if limits is not None:
        target = target_size(width, height, limits)
        if im.format == "JPEG":
            im.draft("RGB", target)  # DCT scaling: decodes at 1/2, 1/4 or 1/8 when that is still enough
    elif max(width, height) / min(width, height) > MAX_ASPECT_RATIO:
        target_size(width, height, ProcessorLimits())  # raises with the shape code
    if decode_cost(im) > MAX_DECODE_BYTES and not (limits is None and im.format == "JPEG"):
        raise ImageRejected(
            ResponseCode.IMAGE_TOO_LARGE,
            f"{name}: {width}x{height} {im.mode} pixels need {decode_cost(im) >> 20} MiB to decode, "
            f"more than the payload's {MAX_DECODE_BYTES >> 20} MiB",
        )
    return target


def open_reduced(source, name: str, limits: ProcessorLimits | None):
    """Decode `source` (a path or bytes) as an RGB picture no larger than about twice the
    processor's target, checking it first (plan). Raises ImageRejected, or ImageRejected with
    IMAGE_UNDECODABLE for data PIL cannot decode."""
    from PIL import Image  # lazy: PIL costs the payload's boot ~0.1 s; only decoding needs it

    fp = io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else source
    # PIL's own bomb guard warns from 89 megapixels; `plan` holds the payload's limits instead.
    Image.MAX_IMAGE_PIXELS = max(Image.MAX_IMAGE_PIXELS or 0, MAX_IMAGE_PIXELS)
    with DECODE_LOCK:
        try:
            with Image.open(fp) as im:
                target = plan(im, name, limits)
                im.load()
                picture: Image.Image = im
                if target is not None:
                    factor = min(picture.width // target[0], picture.height // target[1])
                    if factor >= 2:
                        if picture.mode not in _REDUCIBLE:
                            picture = picture.convert(
                                "RGBA" if "A" in picture.getbands() or "transparency" in picture.info else "RGB"
                            )
                        picture = picture.reduce(factor)
                return picture.convert("RGB")
        except ImageRejected:
            raise
        except Image.DecompressionBombError as exc:
            raise ImageRejected(ResponseCode.IMAGE_TOO_LARGE, f"{name}: {exc}") from None
        except Exception as exc:  # PIL raises many kinds for bad data (DecompressionBombError too)
            raise ImageRejected(
                ResponseCode.IMAGE_UNDECODABLE, f"{name}: not a decodable picture ({type(exc).__name__}: {exc})"
            ) from None
