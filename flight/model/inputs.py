"""Turn a prompt and images into the model's inputs, as Qwen's processor does, without it.

The stock `Qwen3VLProcessor` wants a video processor (torchvision); this builds the same tensors
from the tokenizer and the PIL image processor: the chat-formatted prompt with one
`<|vision_start|><|image_pad|>…<|vision_end|>` run per image, each pad expanded to the image's
merged token count, `mm_token_type_ids`, `pixel_values` and `image_grid_thw`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 100_000_000


class InputError(ValueError):
    """Bad request input (unreadable image, empty prompt, ...). The message is one line."""


@dataclass
class RequestInputs:
    input_ids: torch.Tensor          # (1, S) int64
    mm_token_type_ids: torch.Tensor  # (1, S) int32; 1 at image tokens
    pixel_values: torch.Tensor       # (patches, C*T*P*P) float32
    image_grid_thw: torch.Tensor     # (images, 3) int64
    prompt: str

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_visual_tokens(self) -> int:
        return int(self.mm_token_type_ids.sum())

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in (self.input_ids, self.mm_token_type_ids, self.pixel_values, self.image_grid_thw):
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def load_image(path: str):
    """Open an image file, fully decoded as RGB, or raise InputError with the reason."""
    from PIL import Image, UnidentifiedImageError

    if not os.path.isfile(path):
        raise InputError(f"image not found: {path}")
    size = os.path.getsize(path)
    if size > MAX_IMAGE_BYTES:
        raise InputError(f"image too large: {path} is {size} bytes (limit {MAX_IMAGE_BYTES})")
    try:
        with Image.open(path) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise InputError(f"image too large: {path} is {im.width}x{im.height} pixels")
            return im.convert("RGB")
    except InputError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(f"unreadable image: {path} ({type(exc).__name__}: {exc})") from None


def chat_text(prompt: str, num_images: int) -> str:
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return f"<|im_start|>user\n{vision}{prompt}<|im_end|>\n<|im_start|>assistant\n"


def build_inputs(tokenizer, image_processor, images: list, prompt: str, image_token_id: int) -> RequestInputs:
    if not prompt or not prompt.strip():
        raise InputError("prompt is empty")
    if images:
        processed = image_processor(images=images, return_tensors="pt")
        pixel_values = processed["pixel_values"].to(torch.float32)
        grid = processed["image_grid_thw"].to(torch.int64)
    else:
        pixel_values = torch.zeros(0, 1, dtype=torch.float32)
        grid = torch.zeros(0, 3, dtype=torch.int64)
    merge = image_processor.merge_size
    ids = tokenizer(chat_text(prompt, len(images)), add_special_tokens=False)["input_ids"]
    expanded, image_index = [], 0
    for tok in ids:
        if tok == image_token_id:
            n = int(grid[image_index].prod()) // (merge * merge)
            expanded.extend([image_token_id] * n)
            image_index += 1
        else:
            expanded.append(tok)
    if image_index != len(images):
        raise InputError("the tokenizer does not know the image placeholder token")
    input_ids = torch.tensor([expanded], dtype=torch.int64)
    mm = (input_ids == image_token_id).to(torch.int32)
    return RequestInputs(input_ids, mm, pixel_values, grid, prompt)


def save_inputs(fs, path: str, inputs: RequestInputs, key: dict) -> int:
    """Persist preprocessed inputs (record kind TASK_INPUTS, docs/record-format.md) with the
    `key` they were built under (task, model and processor hashes). Atomic and durable."""
    from common.record import Kind, encode

    meta = {"prompt": inputs.prompt, "digest": inputs.digest(), **key}
    tensors = {"input_ids": inputs.input_ids, "mm_token_type_ids": inputs.mm_token_type_ids,
               "pixel_values": inputs.pixel_values, "image_grid_thw": inputs.image_grid_thw}
    return fs.write_atomic(path, encode(Kind.TASK_INPUTS, meta, tensors).chunks)


def load_inputs(fs, path: str, key: dict) -> tuple[RequestInputs | None, str | None]:
    """Stored inputs if present, intact and built under `key`; else (None, why not) -- the
    caller rebuilds them (a damaged record is never used)."""
    from common.record import Kind, RecordError, decode

    if not fs.exists(path):
        return None, None
    try:
        rec, _ = decode(fs.read(path), expect_kind=Kind.TASK_INPUTS)
    except (RecordError, OSError) as exc:
        return None, getattr(exc, "reason", type(exc).__name__)
    if any(rec.meta.get(k) != v for k, v in key.items()):
        return None, "built_with_other_model_or_task"
    t = rec.tensors
    try:
        inputs = RequestInputs(t["input_ids"], t["mm_token_type_ids"], t["pixel_values"], t["image_grid_thw"],
                               rec.meta["prompt"])
    except KeyError:
        return None, "bad_meta"
    if inputs.digest() != rec.meta.get("digest"):
        return None, "digest_mismatch"
    return inputs, None

