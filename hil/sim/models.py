"""What the simulator needs to know about a model and a request: dimensions and record sizes.

Dimensions of the real models are the public config.json values of the released checkpoints
(language model and vision tower). Record sizes are computed by the code that writes the
records: `flight.checkpoint.store` lays out each record's tensors (`prefill_block_parts`,
`decode_record_tensors`) and `common.record.encoded_size` sizes the result exactly as `encode`
would lay it out (header, metadata, 64-byte alignment, footer).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from common.record import Kind, TensorSpec, encoded_size
from flight.checkpoint.store import decode_record_tensors, prefill_block_parts
from flight.model.inputs import task_inputs_parts, task_pixels_parts
from flight.recovery.cost import ModelDims

#: The request's lifetime checkpoint bytes each record carries in its metadata ("written",
#: docs/record-format.md §1); a value of the width the engine's records hold (msgpack uint32).
WRITTEN_PLACEHOLDER = 1 << 31


def checkpoint_size(kind, meta: dict, tensors: dict) -> int:
    """A checkpoint record's size as the store encodes it: with its "written" offset."""
    return encoded_size(kind, {**meta, "written": WRITTEN_PLACEHOLDER}, tensors)


@dataclass(frozen=True)
class VisionDims:
    depth: int
    hidden: int
    intermediate: int
    patch: int  # pixels per patch side
    merge: int  # spatial merge (2: 2x2 patches -> one LM token)
    deepstack: tuple = ()  # vision blocks whose output feeds a DeepStack merger (Qwen3-VL)
    in_channels: int = 3  # pixel values per patch: in_channels x temporal_patch x patch x patch
    temporal_patch: int = 2

    @property
    def pixels_per_patch(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch

    @property
    def block_params(self) -> int:
        return 4 * self.hidden * self.hidden + 2 * self.hidden * self.intermediate + 4 * self.hidden

    @property
    def params(self) -> int:
        return self.depth * self.block_params


@dataclass(frozen=True)
class ModelSpec:
    name: str
    text: ModelDims
    vision: VisionDims
    dtype: str = "bfloat16"

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def weight_bytes(self) -> int:
        embed = self.text.vocab * self.text.hidden * self.dtype_bytes
        return self.text.layers * self.text.layer_bytes + 2 * embed + self.vision.params * self.dtype_bytes


def _text(name, layers, hidden, heads, kv_heads, head_dim, inter, vocab=151936):
    return ModelDims(name, layers, hidden, heads, kv_heads, head_dim, inter, vocab)


# Public config.json values (text_config / vision_config) of the released checkpoints.
REAL_MODELS = {
    "qwen3-vl-2b": ModelSpec(
        "qwen3-vl-2b", _text("qwen3-vl-2b", 28, 2048, 16, 8, 128, 6144), VisionDims(24, 1024, 4096, 16, 2, (5, 11, 17))
    ),
    "qwen3-vl-4b": ModelSpec(
        "qwen3-vl-4b", _text("qwen3-vl-4b", 36, 2560, 32, 8, 128, 9728), VisionDims(24, 1024, 4096, 16, 2, (5, 11, 17))
    ),
    "qwen3-vl-8b": ModelSpec(
        "qwen3-vl-8b", _text("qwen3-vl-8b", 36, 4096, 32, 8, 128, 12288), VisionDims(27, 1152, 4304, 16, 2, (8, 16, 24))
    ),
    "qwen2.5-vl-3b": ModelSpec(
        "qwen2.5-vl-3b", _text("qwen2.5-vl-3b", 36, 2048, 16, 2, 128, 11008), VisionDims(32, 1280, 3420, 14, 2, ())
    ),
    "qwen2.5-vl-7b": ModelSpec(
        "qwen2.5-vl-7b",
        _text("qwen2.5-vl-7b", 28, 3584, 28, 4, 128, 18944, 152064),
        VisionDims(32, 1280, 3420, 14, 2, ()),
    ),
}


def spec_from_dir(model_dir: str) -> ModelSpec:
    """The spec of a model directory (its config.json), e.g. the testbench's small model."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    t, v = cfg["text_config"], cfg["vision_config"]
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    dtype = str(t.get("dtype") or cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    text = ModelDims(
        os.path.basename(model_dir.rstrip("/")),
        t["num_hidden_layers"],
        t["hidden_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        head_dim,
        t["intermediate_size"],
        t["vocab_size"],
        4 if dtype == "float32" else 2,
    )
    vision = VisionDims(
        v["depth"],
        v["hidden_size"],
        v["intermediate_size"],
        v["patch_size"],
        v.get("spatial_merge_size", 2),
        tuple(v.get("deepstack_visual_indexes") or ()),
        int(v.get("in_channels", 3)),
        int(v.get("temporal_patch_size", 2)),
    )
    return ModelSpec(text.name, text, vision, dtype)


@dataclass(frozen=True)
class Request:
    """One request's shape: visual tokens (after merging), text tokens, answer length."""

    visual_tokens: int
    text_tokens: int
    new_tokens: int
    images: int = 1
    prompt_bytes: int | None = None  # the prompt's UTF-8 bytes (None: 4 per text token)
    image_bytes: int = 0  # the uploaded images' bytes, read back to build the inputs

    @property
    def prompt_tokens(self) -> int:
        return self.visual_tokens + self.text_tokens

    def patches(self, spec: ModelSpec) -> int:
        return self.visual_tokens * spec.vision.merge**2


def frames_request(frames: int, tokens_per_frame: int, text_tokens: int = 96, new_tokens: int = 128) -> Request:
    """The paper's missions: `frames` images of `tokens_per_frame` visual tokens each."""
    return Request(frames * tokens_per_frame, text_tokens, new_tokens, frames)


SHA256_HEX = "0" * 64  # a SHA-256 digest as the payload stores it: 64 hex digits
INPUTS_KEY = {"task": SHA256_HEX, "model": SHA256_HEX, "processors": SHA256_HEX}


class RecordSizes:
    """Bytes of each record kind for one model, request and geometry (group G, chunk C)."""

    def __init__(self, spec: ModelSpec, request: Request, chunk: int, group: int):
        self.spec, self.request, self.chunk, self.group = spec, request, chunk, group
        t = spec.text
        self.dt = spec.dtype
        self.layers = t.layers
        self.groups = [(l0, min(t.layers, l0 + group)) for l0 in range(0, t.layers, group)]
        self.chunks = [(s, min(request.prompt_tokens, s + chunk)) for s in range(0, request.prompt_tokens, chunk)]
        self._cache: dict = {}

    def _kv(self, tokens: int) -> TensorSpec:
        t = self.spec.text
        return TensorSpec(self.dt, (1, t.kv_heads, tokens, t.head_dim))

    def prefill_block(
        self, group: int, chunk: int, kv: bool, hidden: bool, layers: tuple[int, int] | None = None
    ) -> int:
        key = ("blk", group, chunk, kv, hidden, layers)
        if key not in self._cache:
            (l0, l1), (s, e) = layers or self.groups[group], self.chunks[chunk]
            kvs = {layer: (self._kv(e - s), self._kv(e - s)) for layer in range(l0, l1)} if kv else {}
            h = TensorSpec(self.dt, (1, e - s, self.spec.text.hidden)) if hidden else None
            meta, tensors = prefill_block_parts(group, chunk, (l0, l1), (s, e), kvs, h)
            self._cache[key] = checkpoint_size(Kind.PREFILL_BLOCK, meta, tensors)
        return self._cache[key]

    def decode(self, steps: int) -> int:
        key = ("dec", steps)
        if key not in self._cache:
            kvs = {layer: (self._kv(steps), self._kv(steps)) for layer in range(self.layers)}
            meta = {
                "step_start": 1 << 20,
                "step_end": 1 << 20,
                "pos_start": 1 << 20,
                "pos_end": 1 << 20,
                "first_token": 1 << 20,
            }
            self._cache[key] = encoded_size(
                Kind.DECODE_STEPS, meta, decode_record_tensors(kvs, TensorSpec("int64", (steps,)))
            )
        return self._cache[key]

    def _side(self, blocks_done: int | None = None) -> dict:
        """DeepStack features held so far: those of the vision blocks already run."""
        v = self.request.visual_tokens
        return {
            f"deepstack.{j}": TensorSpec(self.dt, (v, self.spec.text.hidden))
            for j, index in enumerate(self.spec.vision.deepstack)
            if blocks_done is None or index < blocks_done
        }

    def vision_state(self, blocks_done: int) -> int:
        key = ("vis", blocks_done)
        if key not in self._cache:
            p = self.request.patches(self.spec)
            self._cache[key] = checkpoint_size(
                Kind.VISION_STATE,
                {"block": blocks_done},
                {"hidden": TensorSpec(self.dt, (p, self.spec.vision.hidden)), **self._side(blocks_done)},
            )
        return self._cache[key]

    @property
    def vision_out(self) -> int:
        return checkpoint_size(
            Kind.VISION_OUT,
            {},
            {"embeds": TensorSpec(self.dt, (self.request.visual_tokens, self.spec.text.hidden)), **self._side()},
        )

    @property
    def result(self) -> int:
        n = self.request.new_tokens
        return checkpoint_size(
            Kind.RESULT,
            {"text": "x" * (8 * n), "finish_reason": "length"},
            {"token_ids": TensorSpec("int64", (n,)), "logits": TensorSpec(self.dt, (1, self.spec.text.vocab))},
        )

    @property
    def task_inputs(self) -> int:
        """The TASK_INPUTS record (flight/model/inputs.py `save_inputs`): token ids, image-token
        mask and the image grid, keyed by three SHA-256 digests (task, model, processors:
        flight/runtime/inputs.py `TaskInputs.key`) besides the inputs' and the pixels' digests and the
        prompt. What every restart reads."""
        r = self.request
        tokens = r.prompt_tokens
        prompt = "x" * (r.prompt_bytes if r.prompt_bytes is not None else 4 * r.text_tokens)
        meta, tensors = task_inputs_parts(
            prompt,
            SHA256_HEX,
            INPUTS_KEY,
            TensorSpec("int64", (1, tokens)),
            TensorSpec("int32", (1, tokens)),
            TensorSpec("int64", (r.images, 3)),
            SHA256_HEX,
        )
        return encoded_size(Kind.TASK_INPUTS, meta, tensors)

    @property
    def task_pixels(self) -> int:
        """The TASK_PIXELS record beside it: the pixel values (float32, one row per patch). What
        a restart reads only when its vision phase starts from the patches."""
        r, v = self.request, self.spec.vision
        meta, tensors = task_pixels_parts(
            INPUTS_KEY,
            SHA256_HEX,
            TensorSpec("float32", (r.patches(self.spec), v.pixels_per_patch) if r.images else (0, 1)),
        )
        return encoded_size(Kind.TASK_PIXELS, meta, tensors)

    MANIFEST_BYTES = 1024  # one small metadata record (hashes, versions, geometry)


def visual_tokens_for_images(spec: ModelSpec, images: int, side_px: int) -> int:
    """Merged visual tokens of `images` square images of `side_px` pixels (processor rounding:
    multiples of patch x merge)."""
    unit = spec.vision.patch * spec.vision.merge
    per_side = max(1, math.ceil(side_px / unit))
    return images * per_side * per_side


def with_dtype(spec: ModelSpec, dtype: str) -> ModelSpec:
    return replace(spec, dtype=dtype)
