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
from collections.abc import Callable

import torch

from common.imagecheck import ImageRejected, ProcessorLimits, open_reduced
from common.record import Kind, RecordError, decode, encode
from common.wire.ids import MAX_IMAGE_PIXELS, ResponseCode  # noqa: F401  (MAX_IMAGE_PIXELS: re-exported)
from common.wire.rules import prompt_rule

MAX_IMAGE_BYTES = 64 << 20


class InputError(ValueError):
    """Bad request input (unreadable image, empty prompt, ...). The message is one line;
    `code` is the response code a task failing on it reports."""

    def __init__(self, message: str, code: ResponseCode = ResponseCode.IMAGE_UNDECODABLE):
        super().__init__(message)
        self.code = code


class RequestInputs:
    """A request's model inputs. `pixel_values` may be loaded only when first asked for
    (`load_pixels`): a stored task resumed past its vision phase never reads its pixel patches
    (tens of MB for a few images) at all. `digest` given: the digest recorded when the inputs
    were stored, so that the MANIFEST's check needs no pixels either."""

    def __init__(
        self,
        input_ids: torch.Tensor,  # (1, S) int64
        mm_token_type_ids: torch.Tensor,  # (1, S) int32; 1 at image tokens
        pixel_values: torch.Tensor | None,  # (patches, C*T*P*P) float32; None: `load_pixels` gives them
        image_grid_thw: torch.Tensor,  # (images, 3) int64
        prompt: str,
        *,
        load_pixels: Callable[[], torch.Tensor | None] | None = None,
        digest: str | None = None,
    ):
        if pixel_values is None and load_pixels is None:
            raise ValueError("inputs need their pixel values or a way to load them")
        self.input_ids, self.mm_token_type_ids, self.image_grid_thw = input_ids, mm_token_type_ids, image_grid_thw
        self.prompt = prompt
        self._pixel_values, self._load_pixels, self._digest = pixel_values, load_pixels, digest

    def pixels(self) -> torch.Tensor | None:
        """The pixel patches, loaded when first asked for; None when the loader cannot give
        them now (the payload waits for an image to be sent again): the engine then ends the
        run with the status AWAITING_INPUTS (flight/events.py), and a later run asks again."""
        if self._pixel_values is None:
            assert self._load_pixels is not None
            self._pixel_values = self._load_pixels()
        return self._pixel_values

    @property
    def pixel_values(self) -> torch.Tensor:
        """The pixel patches, where they must be had (PixelsUnavailable when they cannot be)."""
        pixels = self.pixels()
        if pixels is None:
            raise PixelsUnavailable("awaiting_inputs")
        return pixels

    @property
    def pixels_loaded(self) -> bool:
        return self._pixel_values is not None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_visual_tokens(self) -> int:
        return int(self.mm_token_type_ids.sum())

    def digest(self) -> str:
        if self._digest is None:
            self._digest = _digest(self.input_ids, self.mm_token_type_ids, self.pixel_values, self.image_grid_thw)
        return self._digest


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
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
    broken = prompt_rule(prompt)  # the wire's rule (UPLINK_TASK), for prompts that did not come over it
    if broken is not None:
        raise InputError(broken.reason, broken.code)
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


#: beside a task's TASK_INPUTS record (`inputs.rec`): its pixel patches (TASK_PIXELS)
PIXELS_FILE = "pixels.rec"


class PixelsUnavailable(Exception):
    """The stored pixel record cannot be used (missing, damaged, of other inputs): `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def pixels_path(inputs_path: str) -> str:
    return os.path.join(os.path.dirname(inputs_path), PIXELS_FILE)


def task_inputs_parts(prompt: str, digest: str, key: dict, input_ids, mm_token_type_ids, grid, pixels_digest: str):
    """(meta, tensors) of a TASK_INPUTS record: the one layout `save_inputs` writes and the
    lifecycle simulator sizes (hil/sim/models.py, with tensor specs in place of tensors)."""
    meta = {"prompt": prompt, "digest": digest, "pixels_digest": pixels_digest, **key}
    tensors = {"input_ids": input_ids, "mm_token_type_ids": mm_token_type_ids, "image_grid_thw": grid}
    return meta, tensors


def task_pixels_parts(key: dict, pixels_digest: str, pixel_values):
    """(meta, tensors) of a TASK_PIXELS record, likewise."""
    return {"pixels_digest": pixels_digest, **key}, {"pixel_values": pixel_values}


def save_inputs(fs, path: str, inputs: RequestInputs, key: dict) -> int:
    """Persist preprocessed inputs with the `key` they were built under (task, model and processor
    hashes), atomic and durable, in two records (docs/record-format.md): the pixel patches first
    (TASK_PIXELS, `pixels.rec`), then the rest (TASK_INPUTS at `path`), which commits both -- a
    cut between the two leaves no TASK_INPUTS record, and the inputs are built again. Returns
    the bytes written."""

    pixels_digest = _digest(inputs.pixel_values)
    pixel_meta, pixel_tensors = task_pixels_parts(key, pixels_digest, inputs.pixel_values)
    written = fs.write_atomic(pixels_path(path), encode(Kind.TASK_PIXELS, pixel_meta, pixel_tensors).chunks)
    meta, tensors = task_inputs_parts(
        inputs.prompt,
        inputs.digest(),
        key,
        inputs.input_ids,
        inputs.mm_token_type_ids,
        inputs.image_grid_thw,
        pixels_digest,
    )
    return written + fs.write_atomic(path, encode(Kind.TASK_INPUTS, meta, tensors).chunks)


def load_pixels(fs, path: str, key: dict, pixels_digest: str) -> torch.Tensor:
    """The pixel patches stored beside the TASK_INPUTS record at `path`, checked against the
    digest that record holds; PixelsUnavailable(reason) if they cannot be used."""
    try:
        rec, _ = decode(fs.read(pixels_path(path)), expect_kind=Kind.TASK_PIXELS)
    except FileNotFoundError:
        raise PixelsUnavailable("missing") from None
    except (RecordError, OSError) as exc:
        raise PixelsUnavailable(getattr(exc, "reason", type(exc).__name__)) from None
    if any(rec.meta.get(k) != v for k, v in key.items()) or rec.meta.get("pixels_digest") != pixels_digest:
        raise PixelsUnavailable("of_other_inputs")
    pixels = rec.tensors.get("pixel_values")
    if pixels is None or _digest(pixels) != pixels_digest:
        raise PixelsUnavailable("digest_mismatch")
    return pixels


def load_inputs(
    fs, path: str, key: dict, rebuild_pixels: Callable[[str], torch.Tensor | None] | None = None
) -> tuple[RequestInputs | None, str | None]:
    """Stored inputs if present, intact and built under `key`; else (None, why not) -- the
    caller rebuilds them (a damaged record is never used). The pixel patches are read only when
    first asked for; if they cannot be used then, `rebuild_pixels(reason)` gives them (the
    payload builds them again from the task's images) or None (not now: the payload waits for
    an image; `RequestInputs.pixels()` answers None), else PixelsUnavailable is raised. A
    record of the earlier layout, pixels inside, is read whole."""

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
        ids, mm, grid, prompt = t["input_ids"], t["mm_token_type_ids"], t["image_grid_thw"], rec.meta["prompt"]
        stored_digest = rec.meta["digest"]
    except KeyError:
        return None, "bad_meta"
    if "pixel_values" in t:  # the earlier layout: one record
        inputs = RequestInputs(ids, mm, t["pixel_values"], grid, prompt)
        if inputs.digest() != stored_digest:
            return None, "digest_mismatch"
        return inputs, None
    pixels_digest = rec.meta.get("pixels_digest")
    if not isinstance(pixels_digest, str):
        return None, "bad_meta"

    def pixels() -> torch.Tensor | None:
        try:
            return load_pixels(fs, path, key, pixels_digest)
        except PixelsUnavailable as exc:
            if rebuild_pixels is None:
                raise
            rebuilt = rebuild_pixels(exc.reason)
        if rebuilt is None:
            return None  # not now: asked again at the request's next run
        # Built again under the same key, they are the same bits; if not, the task's records
        # were computed from other inputs, and no answer from them may be given.
        if _digest(rebuilt) != pixels_digest:
            raise PixelsUnavailable("rebuilt_pixels_differ")
        return rebuilt

    return RequestInputs(ids, mm, None, grid, prompt, load_pixels=pixels, digest=stored_digest), None
