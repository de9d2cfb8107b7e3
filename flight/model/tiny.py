"""Build complete local model directories with seeded random weights.

No weights can be downloaded here, so tests, the demo and the benchmarks use models built from
configs: the real transformers classes, random weights from a fixed seed, saved with
`save_pretrained` (config.json, model.safetensors, generation_config.json), a word-level
tokenizer carrying the model's special tokens, and an image-processor config. The directory loads
exactly as a downloaded checkpoint does.

Sizes: `tiny` (hidden 128, 4 layers, 4 vision blocks; ~1 M parameters, for tests) and `small`
(hidden 768, 12 layers, 8 vision blocks; ~100 M parameters, for benchmarks: big enough that
checkpoint I/O and compute are both visible). `qwen3-vl-2b` / `qwen3-vl-8b` give the real
dimensions of those checkpoints (random weights) for accelerator benchmarks.
"""

from __future__ import annotations

import json
import os
from typing import TypedDict

import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "[UNK]",
]

# A small English vocabulary with Earth-observation words, so prompts tokenize meaningfully.
_WORDS = """
a an the of and or to in on at by for with from over under above below near far between across
is are was were be been has have had do does did can could will would should may might must
what which who where when why how many much some any all each every no not only also very more
most less few other same different this that these those it its they them their there here
image images picture frame scene view photo satellite orbit ground station payload mission
describe count list find locate identify detect classify compare summarize report explain tell
show give name estimate measure mark track watch observe check answer question yes
cloud clouds cover sky sun shadow light dark night day morning evening smoke haze fog snow ice
water river lake sea ocean coast shore beach bay harbor port island wave flood wet dry
land field fields farm crop crops forest tree trees grass desert sand dune mountain hill valley
rock soil mud road roads highway bridge railway airport runway building buildings house houses
city town village urban rural industrial factory tank tanks pipe pipeline plant power solar
ship ships boat boats vessel vessels aircraft plane planes car cars truck trucks train vehicle
fire burn burned area areas region zone border line edge center north south east west left right
top bottom upper lower middle small large big tiny huge long short wide narrow high low
red green blue white black gray brown yellow orange bright dim clear visible hidden
one two three four five six seven eight nine ten dozen hundred thousand number percent
change changed damage damaged new old before after during since until while again still
move moving moved stop stopped open closed full empty heavy light fast slow
storm rain wind hurricane cyclone earthquake landslide drought volcano ash lava
"""


def vocabulary() -> list[str]:
    words, seen = [], set()
    for w in _WORDS.split():
        if w not in seen:
            seen.add(w)
            words.append(w)
    return SPECIAL_TOKENS + words + [".", ",", "?", "!", ":", "-", "'"]


SIZES = {
    # name: (text dims, vision dims)
    "tiny": dict(
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=32,
        inter=256,
        v_depth=4,
        v_hidden=64,
        v_heads=4,
        v_inter=128,
        v_pos=64,
        max_pixels=128 * 128,
    ),
    "small": dict(
        hidden=768,
        layers=12,
        heads=12,
        kv_heads=4,
        head_dim=64,
        inter=2048,
        v_depth=8,
        v_hidden=384,
        v_heads=6,
        v_inter=1536,
        v_pos=1024,
        max_pixels=512 * 512,
    ),
    # Real Qwen3-VL dimensions (random weights) for accelerator benchmarks.
    "qwen3-vl-2b": dict(
        hidden=2048,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        inter=6144,
        v_depth=24,
        v_hidden=1024,
        v_heads=16,
        v_inter=4096,
        v_pos=2304,
        max_pixels=16384 * 32 * 32,
        vocab=151936,
    ),
    "qwen3-vl-8b": dict(
        hidden=4096,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        inter=12288,
        v_depth=27,
        v_hidden=1152,
        v_heads=16,
        v_inter=4304,
        v_pos=2304,
        max_pixels=16384 * 32 * 32,
        vocab=151936,
    ),
}
ARCHS = {"qwen3-vl": "qwen3_vl", "qwen2.5-vl": "qwen2_5_vl"}


def _mrope_section(head_dim: int, interleaved: bool) -> list[int]:
    half = head_dim // 2
    if interleaved:  # Qwen3-VL: [24, 20, 20] for head_dim 128
        h = w = (half * 20) // 64
        return [half - h - w, h, w]
    t = half // 4  # Qwen2.5-VL: [16, 24, 24] for head_dim 128
    return [t, (half - t) // 2, half - t - (half - t) // 2]


class _VisionTokenIds(TypedDict):
    """The special-token ids both configs take as keyword arguments (typed, so each is checked)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


def make_config(arch: str, size: str, vocab_size: int, special_ids: dict[str, int], dtype: str):
    # lazy: torch/transformers (seconds to import), only when a model is built
    from transformers import PreTrainedConfig, Qwen2_5_VLConfig, Qwen3VLConfig

    s = SIZES[size]
    vocab_size = s.get("vocab", vocab_size)
    cfg: Qwen3VLConfig | Qwen2_5_VLConfig
    ids = _VisionTokenIds(
        image_token_id=special_ids["<|image_pad|>"],
        video_token_id=special_ids["<|video_pad|>"],
        vision_start_token_id=special_ids["<|vision_start|>"],
        vision_end_token_id=special_ids["<|vision_end|>"],
    )
    if arch == "qwen3-vl":
        depth = s["v_depth"]
        deepstack = [depth // 4, depth // 2, 3 * depth // 4] if depth >= 8 else [1, 2]
        cfg = Qwen3VLConfig(
            text_config=dict(
                vocab_size=vocab_size,
                hidden_size=s["hidden"],
                intermediate_size=s["inter"],
                num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"],
                num_key_value_heads=s["kv_heads"],
                head_dim=s["head_dim"],
                max_position_embeddings=262144,
                tie_word_embeddings=False,
                rope_parameters=dict(
                    rope_type="default",
                    rope_theta=5_000_000.0,
                    mrope_section=_mrope_section(s["head_dim"], True),
                    mrope_interleaved=True,
                ),
                eos_token_id=special_ids["<|im_end|>"],
                pad_token_id=special_ids["<|endoftext|>"],
                bos_token_id=None,
            ),
            vision_config=dict(
                depth=depth,
                hidden_size=s["v_hidden"],
                intermediate_size=s["v_inter"],
                num_heads=s["v_heads"],
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=s["hidden"],
                num_position_embeddings=s["v_pos"],
                deepstack_visual_indexes=deepstack,
            ),
            tie_word_embeddings=False,
            **ids,
        )
    elif arch == "qwen2.5-vl":
        depth = s["v_depth"]
        cfg = Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=vocab_size,
                hidden_size=s["hidden"],
                intermediate_size=s["inter"],
                num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"],
                num_key_value_heads=s["kv_heads"],
                max_position_embeddings=32768,
                rope_parameters=dict(
                    rope_type="default",
                    rope_theta=1_000_000.0,
                    mrope_section=_mrope_section(s["hidden"] // s["heads"], False),
                ),
                eos_token_id=special_ids["<|im_end|>"],
                pad_token_id=special_ids["<|endoftext|>"],
                bos_token_id=None,
            ),
            vision_config=dict(
                depth=depth,
                hidden_size=s["v_hidden"],
                intermediate_size=s["v_inter"],
                num_heads=s["v_heads"],
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=s["hidden"],
                window_size=56,
                fullatt_block_indexes=[depth // 2 - 1, depth - 1],
            ),
            tie_word_embeddings=False,
            **ids,
        )
    else:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    cfg.dtype = dtype
    for sub_config in (cfg.text_config, cfg.vision_config):
        assert isinstance(sub_config, PreTrainedConfig)  # the config turned the dicts above into configs
        sub_config.dtype = dtype
    return cfg


def build_tokenizer(out_dir: str):
    # lazy: torch/transformers (seconds to import), only when a model is built
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("[UNK]", "<|endoftext|>", "<|im_end|>")],
    )
    fast.save_pretrained(out_dir)
    return fast


def build_tiny(arch: str, size: str, seed: int, out_dir: str, dtype: str = "float32") -> dict:
    """Write a complete model directory; returns a summary (parameters, bytes, files)."""
    # lazy: torch/transformers (seconds to import), only when a model is built
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    special_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = make_config(arch, size, len(tokenizer), special_ids, dtype)
    cls = Qwen3VLForConditionalGeneration if arch == "qwen3-vl" else Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=special_ids["<|im_end|>"], pad_token_id=special_ids["<|endoftext|>"], do_sample=False
    )
    model.save_pretrained(out_dir)
    patch = config.vision_config.patch_size
    processor = Qwen2VLImageProcessorPil(
        patch_size=patch,
        temporal_patch_size=2,
        merge_size=2,
        min_pixels=(patch * 2) ** 2 * 4,
        max_pixels=SIZES[size]["max_pixels"],
    )
    processor.save_pretrained(out_dir)
    params = sum(p.numel() for p in model.parameters())
    summary = {
        "arch": arch,
        "size": size,
        "seed": seed,
        "dtype": dtype,
        "parameters": params,
        "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)),
        "files": sorted(os.listdir(out_dir)),
        "path": os.path.abspath(out_dir),
    }
    with open(os.path.join(out_dir, "orbitweaver-build.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k != "path"}, f, indent=2)
    return summary
