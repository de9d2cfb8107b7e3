"""Architecture adapters: drive the real transformers model classes block by block.

An adapter knows, for one model family, how to run one vision block, one decoder layer on one
token chunk, and what surrounds them (patch embedding, mergers, DeepStack, M-RoPE positions,
final norm and LM head). It calls the transformers modules themselves — never a re-implementation
— with exactly the arguments their own `forward` passes, so a block-wise run is bitwise equal to
`generate()` (tests/engine/test_equivalence.py proves it).

It also names the weight groups (dotted module paths) each step needs, for lazy loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.utils.generic import get_max_seqlen
from transformers.vision_utils import (
    get_vision_attention_seqlens,
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
    get_vision_window_index,
)


@dataclass
class VisionContext:
    """Per-request constants of the vision tower (recomputed on resume; cheap, deterministic)."""

    grid_thw: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    extra: dict = field(default_factory=dict)


def _plain_attribute(module: torch.nn.Module, name: str) -> Any:
    """A model attribute that is no submodule (a method, a config), for the caller to type.

    torch's stubs give every attribute of a Module the type `Tensor | Module`; submodules are
    read with `get_submodule`, which is typed, and the rest through here."""
    return getattr(module, name)


class _Captured(Exception):
    def __init__(self, keys, values):
        super().__init__("captured")
        self.keys, self.values = keys, values


class _KVCapture:
    """A stand-in cache whose update() captures the new keys/values and stops the attention."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise _Captured(key_states, value_states)


class Adapter:
    """Base class; see Qwen3VLAdapter for the reference implementation."""

    model_type: str = ""
    vision_prefix = "model.visual"
    lm_prefix = "model.language_model"

    def __init__(self, model: torch.nn.Module, config):
        self.model = model
        self.config = config
        self.text_config = config.text_config
        self.vision_config = config.vision_config
        self.visual = model.get_submodule("model.visual")
        self.lm = model.get_submodule("model.language_model")

    # ---- geometry -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_vision_blocks(self) -> int:
        return self.vision_config.depth

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def deepstack_layers(self) -> int:
        """How many leading LM layers receive DeepStack visual features (0 = none)."""
        return 0

    # ---- weight groups ----------------------------------------------------------------------
    def vision_prologue_modules(self) -> list[str]:
        raise NotImplementedError

    def vision_block_modules(self, i: int) -> list[str]:
        return [f"{self.vision_prefix}.blocks.{i}"]

    def vision_epilogue_modules(self) -> list[str]:
        return [f"{self.vision_prefix}.merger"]

    def embed_modules(self) -> list[str]:
        return [f"{self.lm_prefix}.embed_tokens", f"{self.lm_prefix}.rotary_emb"]

    def layer_modules(self, layer: int) -> list[str]:
        return [f"{self.lm_prefix}.layers.{layer}"]

    def head_modules(self) -> list[str]:
        return [f"{self.lm_prefix}.norm", "lm_head"]

    def all_vision_modules(self) -> list[str]:
        out = self.vision_prologue_modules()
        for i in range(self.num_vision_blocks):
            out += self.vision_block_modules(i)
        return out + self.vision_epilogue_modules()

    def all_lm_modules(self) -> list[str]:
        out = self.embed_modules()
        for layer in range(self.num_layers):
            out += self.layer_modules(layer)
        return out + self.head_modules()

    # ---- vision -----------------------------------------------------------------------------
    def vision_context(self, grid_thw: torch.Tensor, device: torch.device) -> VisionContext:
        raise NotImplementedError

    def vision_embed(self, ctx: VisionContext, pixel_values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def vision_block(self, ctx: VisionContext, i: int, h: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Run vision block i; returns the new hidden state and any side features {name: tensor}."""
        raise NotImplementedError

    def vision_finish(self, ctx: VisionContext, h: torch.Tensor) -> torch.Tensor:
        """Merger; returns the visual token embeddings in prompt order."""
        raise NotImplementedError

    # ---- language model ---------------------------------------------------------------------
    def rope_index(self, input_ids, mm_token_type_ids, grid_thw) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (position_ids (4, 1, S): text row then the three M-RoPE rows, rope_deltas (1, 1))."""
        get_rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]] = _plain_attribute(
            self.model.get_submodule("model"), "get_rope_index"
        )
        pos3, deltas = get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=grid_thw,
            attention_mask=torch.ones_like(input_ids),
        )
        text = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return torch.cat([text[None], pos3], dim=0), deltas

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm.get_submodule("embed_tokens")(input_ids)

    def mask(
        self, h: torch.Tensor, attention_mask: torch.Tensor, cache, text_positions: torch.Tensor, layer_idx: int = 0
    ):
        lm_config: PreTrainedConfig = _plain_attribute(self.lm, "config")
        return create_causal_mask(
            config=lm_config,
            inputs_embeds=h,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=text_positions,
            layer_idx=layer_idx,
        )

    def rotary(self, h: torch.Tensor, mrope_positions: torch.Tensor):
        return self.lm.get_submodule("rotary_emb")(h, mrope_positions)

    def layer(self, layer: int, h, mask, text_positions, cache, position_embeddings) -> torch.Tensor:
        return self.lm.get_submodule(f"layers.{layer}")(
            h,
            attention_mask=mask,
            position_ids=text_positions,
            cache=cache,
            use_cache=True,
            position_embeddings=position_embeddings,
        )

    def after_layer(
        self, layer: int, h: torch.Tensor, visual_mask: torch.Tensor | None, deepstack_rows: torch.Tensor | None
    ) -> torch.Tensor:
        return h

    def reproject_kv(self, layer: int, h_in: torch.Tensor, text_positions, position_embeddings):
        """KV of `layer` for a chunk, rebuilt from the layer's input hidden state (HCache).

        Runs the layer's own input norm and attention module up to the point where attention
        hands its new keys and values to the cache, and stops there: the same code path as the
        forward pass, so the bits are the same, without the attention and MLP work."""
        mod = self.lm.get_submodule(f"layers.{layer}")
        try:
            mod.get_submodule("self_attn")(
                hidden_states=mod.get_submodule("input_layernorm")(h_in),
                attention_mask=None,
                position_ids=text_positions,
                cache=_KVCapture(),
                use_cache=True,
                position_embeddings=position_embeddings,
            )
        except _Captured as captured:
            return captured.keys, captured.values
        raise RuntimeError(f"layer {layer}'s attention never updated its cache")

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Logits of the last position of `h_last` (B, T, H) -> (B, V), as generate computes them."""
        return self.model.get_submodule("lm_head")(self.lm.get_submodule("norm")(h_last)[:, -1:, :])[:, -1]


class Qwen3VLAdapter(Adapter):
    model_type = "qwen3_vl"

    @property
    def deepstack_layers(self) -> int:
        return len(self.vision_config.deepstack_visual_indexes)

    def vision_prologue_modules(self):
        p = self.vision_prefix
        return [f"{p}.patch_embed", f"{p}.pos_embed", f"{p}.rotary_pos_emb"]

    def vision_block_modules(self, i):
        mods = [f"{self.vision_prefix}.blocks.{i}"]
        indexes = list(self.vision_config.deepstack_visual_indexes)
        if i in indexes:
            mods.append(f"{self.vision_prefix}.deepstack_merger_list.{indexes.index(i)}")
        return mods

    def vision_context(self, grid_thw, device):
        vis = self.visual
        position_ids = get_vision_position_ids(grid_thw, vis.spatial_merge_size, kwargs={})
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, vis.config, kwargs={})
        probe = torch.empty(0, device=device, dtype=torch.float32)
        position_embeddings = vis.rotary_pos_emb(probe, position_ids.to(device))
        interp = get_vision_interpolation_indices_and_weights(
            grid_thw,
            num_grid_per_side=vis.num_grid_per_side,
            mode=vis.interpolation_mode,
            align_corners=vis.interpolation_align_corners,
            spatial_merge_size=vis.config.spatial_merge_size,
            kwargs={},
        )
        return VisionContext(grid_thw, cu_seqlens.to(device), max_seqlen, position_embeddings, extra={"interp": interp})

    def vision_embed(self, ctx, pixel_values):
        vis = self.visual
        interp_indices, interp_weights = ctx.extra["interp"]
        h = vis.patch_embed(pixel_values.type(vis.dtype))
        pos_embeds = (vis.pos_embed(interp_indices.to(h.device)) * interp_weights.to(h.device)[:, :, None]).sum(1)
        return h + pos_embeds.to(h.dtype)

    def vision_block(self, ctx, i, h):
        vis = self.visual
        h = vis.blocks[i](
            h, cu_seqlens=ctx.cu_seqlens, max_seqlen=ctx.max_seqlen, position_embeddings=ctx.position_embeddings
        )
        side = {}
        indexes = list(vis.deepstack_visual_indexes)
        if i in indexes:
            j = indexes.index(i)
            side[f"deepstack.{j}"] = vis.deepstack_merger_list[j](h)
        return h, side

    def vision_finish(self, ctx, h):
        return self.visual.merger(h)

    def after_layer(self, layer, h, visual_mask, deepstack_rows):
        if deepstack_rows is None or visual_mask is None or not bool(visual_mask.any()):
            return h
        return self.lm._deepstack_process(h, visual_mask, deepstack_rows)


class Qwen25VLAdapter(Adapter):
    model_type = "qwen2_5_vl"

    def vision_prologue_modules(self):
        p = self.vision_prefix
        return [f"{p}.patch_embed", f"{p}.rotary_pos_emb"]

    def vision_context(self, grid_thw, device):
        vis = self.visual
        position_ids = get_vision_position_ids(grid_thw, vis.spatial_merge_size, kwargs={})
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, vis.config, kwargs={})
        window_index, cu_window = get_vision_window_index(
            grid_thw,
            spatial_merge_size=vis.spatial_merge_size,
            window_size=vis.window_size,
            patch_size=vis.patch_size,
            kwargs={},
        )
        max_window = get_max_seqlen(cu_window, vis.config, kwargs={}, kwarg_name="max_window_seqlen")
        seq_len = int(grid_thw.prod(-1).sum())
        probe = torch.empty(0, device=device, dtype=torch.float32)
        cos_sin = vis.rotary_pos_emb(probe, position_ids.to(device))
        cos_sin = tuple(vis.permute_input_for_window_attn(t, window_index.to(device), seq_len=seq_len) for t in cos_sin)
        return VisionContext(
            grid_thw,
            cu_seqlens.to(device),
            max_seqlen,
            cos_sin,
            extra={
                "window_index": window_index.to(device),
                "cu_window": cu_window.to(device),
                "max_window": max_window,
                "seq_len": seq_len,
            },
        )

    def vision_embed(self, ctx, pixel_values):
        vis = self.visual
        h = vis.patch_embed(pixel_values.type(vis.dtype))
        return vis.permute_input_for_window_attn(h, ctx.extra["window_index"], seq_len=ctx.extra["seq_len"])

    def vision_block(self, ctx, i, h):
        vis = self.visual
        if i in vis.fullatt_block_indexes:
            cu, mx = ctx.cu_seqlens, ctx.max_seqlen
        else:
            cu, mx = ctx.extra["cu_window"], ctx.extra["max_window"]
        return vis.blocks[i](h, cu_seqlens=cu, max_seqlen=mx, position_embeddings=ctx.position_embeddings), {}

    def vision_finish(self, ctx, h):
        merged = self.visual.merger(h)
        return merged[torch.argsort(ctx.extra["window_index"]), :]


ADAPTERS = {cls.model_type: cls for cls in (Qwen3VLAdapter, Qwen25VLAdapter)}
SUPPORTED = sorted(ADAPTERS)
