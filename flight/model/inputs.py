"""Turn a prompt and images into the model's inputs, as Qwen's processor does, without it.

The stock `Qwen3VLProcessor` wants a video processor (torchvision); this builds the same tensors
from the tokenizer and the PIL image processor: the chat-formatted prompt with one
`<|vision_start|><|image_pad|>…<|vision_end|>` run per image, each pad expanded to the image's
merged token count, `mm_token_type_ids`, `pixel_values` and `image_grid_thw`.

The user's prompt is plain text: the chat template's control tokens are placed by id, and the
prompt is tokenized with `split_special_tokens`, so `<|image_pad|>` or `<|im_end|>` typed in a
prompt are words, never an image slot or a turn boundary. For a prompt without such strings the
ids are exactly those of tokenizing the whole chat text (the tokenizer splits at special tokens
first; tests/flight/test_prompt_text.py).

Images are decoded by `common.imagecheck.open_reduced`: checked from their header, decoded no
larger than the processor needs, one at a time.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from common.imagecheck import ImageRejected, ProcessorLimits, open_reduced
from common.record import Kind, RecordError, decode, encode
from common.wire.ids import MAX_IMAGE_PIXELS, ResponseCode  # noqa: F401  (MAX_IMAGE_PIXELS: re-exported)

MAX_IMAGE_BYTES = 64 << 20


class InputError(ValueError):
    """Bad request input (unreadable image, empty prompt, ...). The message is one line;
    `code` is the response code a task failing on it reports."""

    def __init__(self, message: str, code: ResponseCode = ResponseCode.IMAGE_UNDECODABLE):
        super().__init__(message)
        self.code = code


@dataclass
class RequestInputs:
    input_ids: torch.Tensor  # (1, S) int64
    mm_token_type_ids: torch.Tensor  # (1, S) int32; 1 at image tokens
    pixel_values: torch.Tensor  # (patches, C*T*P*P) float32
    image_grid_thw: torch.Tensor  # (images, 3) int64
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


def load_image(path: str, limits: ProcessorLimits | None = None, name: str | None = None):
    """Open an image file as an RGB picture, or raise InputError with the reason and code.

    With `limits` (the model's image processor, `ProcessorLimits.of_processor`), the picture is
    decoded no larger than about twice the size the processor resizes it to; without, at full
    size (still within the payload's decode budget)."""
    name = name or path
    if not os.path.isfile(path):
        raise InputError(f"image not found: {name}")
    size = os.path.getsize(path)
    if size > MAX_IMAGE_BYTES:
        raise InputError(
            f"image too large: {name} is {size} bytes (limit {MAX_IMAGE_BYTES})", ResponseCode.IMAGE_TOO_LARGE
        )
    try:
        return open_reduced(path, name, limits)
    except ImageRejected as exc:
        raise InputError(str(exc), exc.code) from None


def decode_image(content: bytes, name: str, image_processor=None):
    """An uploaded picture's bytes as an RGB picture, decoded no larger than `image_processor`
    needs (see load_image); InputError with the reason and code if it cannot be."""
    limits = ProcessorLimits.of_processor(image_processor) if image_processor is not None else None
    try:
        return open_reduced(content, name, limits)
    except ImageRejected as exc:
        raise InputError(str(exc), exc.code) from None


def inputs_from_files(model, image_paths: list[str], prompt: str) -> RequestInputs:
    """A loaded model's inputs for picture files and a prompt, decoded exactly as the payload
    decodes uploads (so references computed here match its answers bit for bit)."""
    limits = ProcessorLimits.of_processor(model.image_processor)
    images = [load_image(p, limits) for p in image_paths]
    return build_inputs(model.tokenizer, model.image_processor, images, prompt, model.adapter.image_token_id)


def chat_text(prompt: str, num_images: int) -> str:
    """The chat template as text (for reading; the ids come from `chat_ids`)."""
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * num_images
    return f"<|im_start|>user\n{vision}{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chat_ids(tokenizer, prompt: str, num_images: int) -> list[int]:
    """Token ids of `chat_text(prompt, num_images)` with the prompt as plain text."""
    special = tokenizer.convert_tokens_to_ids

    def text(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False, split_special_tokens=True)["input_ids"] if s else []

    vision = [special("<|vision_start|>"), special("<|image_pad|>"), special("<|vision_end|>")] * num_images
    head = text("user\n") + vision + text(prompt) if num_images else text("user\n" + prompt)
    return (
        [special("<|im_start|>")]
        + head
        + [special("<|im_end|>")]
        + text("\n")
        + [special("<|im_start|>")]
        + text("assistant\n")
    )


def build_inputs(tokenizer, image_processor, images: list, prompt: str, image_token_id: int) -> RequestInputs:
    if not prompt or not prompt.strip():
        raise InputError("prompt is empty or only whitespace", ResponseCode.EMPTY_PROMPT)
    if images:
        processed = image_processor(images=images, return_tensors="pt")
        pixel_values = processed["pixel_values"].to(torch.float32)
        grid = processed["image_grid_thw"].to(torch.int64)
    else:
        pixel_values = torch.zeros(0, 1, dtype=torch.float32)
        grid = torch.zeros(0, 3, dtype=torch.int64)
    merge = image_processor.merge_size
    ids = chat_ids(tokenizer, prompt, len(images))
    expanded, image_index = [], 0
    for tok in ids:
        if tok == image_token_id and image_index < len(images):
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


def task_inputs_parts(prompt: str, digest: str, key: dict, input_ids, mm_token_type_ids, pixel_values, grid):
    """(meta, tensors) of a TASK_INPUTS record: the one layout `save_inputs` writes and the
    lifecycle simulator sizes (hil/sim/models.py, with tensor specs in place of tensors)."""
    meta = {"prompt": prompt, "digest": digest, **key}
    tensors = {
        "input_ids": input_ids,
        "mm_token_type_ids": mm_token_type_ids,
        "pixel_values": pixel_values,
        "image_grid_thw": grid,
    }
    return meta, tensors


def save_inputs(fs, path: str, inputs: RequestInputs, key: dict) -> int:
    """Persist preprocessed inputs (record kind TASK_INPUTS, docs/record-format.md) with the
    `key` they were built under (task, model and processor hashes). Atomic and durable."""

    meta, tensors = task_inputs_parts(
        inputs.prompt,
        inputs.digest(),
        key,
        inputs.input_ids,
        inputs.mm_token_type_ids,
        inputs.pixel_values,
        inputs.image_grid_thw,
    )
    return fs.write_atomic(path, encode(Kind.TASK_INPUTS, meta, tensors).chunks)


def load_inputs(fs, path: str, key: dict) -> tuple[RequestInputs | None, str | None]:
    """Stored inputs if present, intact and built under `key`; else (None, why not) -- the
    caller rebuilds them (a damaged record is never used)."""

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
        inputs = RequestInputs(
            t["input_ids"], t["mm_token_type_ids"], t["pixel_values"], t["image_grid_thw"], rec.meta["prompt"]
        )
    except KeyError:
        return None, "bad_meta"
    if inputs.digest() != rec.meta.get("digest"):
        return None, "digest_mismatch"
    return inputs, None
