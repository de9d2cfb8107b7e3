"""The two-stage VLA model: a VLM stage, then an action diffusion transformer (ADiT).

Real torch modules with random weights, built from an `ArchConfig`:

* `VlmStage`: patch-embedding vision encoder (optionally SmolVLM pixel shuffle) over every camera
  slot, prompt token embeddings, optional state token, then a bidirectional transformer over the
  whole prefix (pi0's prefix attention is bidirectional). Output: prefix features + mask.
* `AditStage`: the action expert. Each layer projects the prefix to keys/values once (the
  "prefix KV cache" the VLM hands over, as pi0's expert attends to the VLM's KV) and then runs
  `denoise_steps` flow-matching Euler steps over the action tokens (plus a state token for pi0).

`VlaPolicy` wraps both, turns an `Observation` into per-request tensors, and runs stage batches
(fixed padded batch sizes, pad rows discarded) so that the serving engine can run the two stages
on different executors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.vla.config import ArchConfig, ModelSpec

# Byte-level tokenizer: tiny random models have no trained vocabulary, so prompts map to UTF-8 bytes.
PAD_ID, BOS_ID, BYTE_OFFSET = 0, 1, 4
VOCAB_SIZE = 256 + BYTE_OFFSET


def tokenize(prompt: str, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    ids = [BOS_ID] + [b + BYTE_OFFSET for b in prompt.encode("utf-8")][: max_tokens - 1]
    tokens = np.full(max_tokens, PAD_ID, dtype=np.int64)
    tokens[: len(ids)] = ids
    mask = np.zeros(max_tokens, dtype=bool)
    mask[: len(ids)] = True
    return tokens, mask


@dataclass
class Observation:
    """One robot observation, already validated (see `wire.parse_observation`)."""

    images: list[np.ndarray]  # uint8, (H, W, 3), one per provided camera
    state: np.ndarray  # float32, (state_dim,)
    prompt: str
    noise_seed: int = 0


@dataclass
class PolicyInputs:
    """Per-request tensors for the VLM and ADiT stages (unbatched)."""

    images: torch.Tensor  # (cameras, 3, H, W) in [-1, 1]
    image_mask: torch.Tensor  # (cameras,) bool
    tokens: torch.Tensor  # (T,) int64
    token_mask: torch.Tensor  # (T,) bool
    state: torch.Tensor  # (state_dim,)
    noise: torch.Tensor  # (horizon, model_action_dim): the flow's starting point


@dataclass
class PrefixState:
    """What the VLM stage hands to the ADiT stage for one request."""

    features: torch.Tensor  # (P, hidden)
    mask: torch.Tensor  # (P,) bool


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, key_mask, prefix_kv=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if prefix_kv is not None:
            k = torch.cat([prefix_kv[0], k], dim=2)
            v = torch.cat([prefix_kv[1], v], dim=2)
        # key_mask: (B, keys) bool, True = attend.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])
        return self.out(o.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim), nn.GELU(approximate="tanh"), nn.Linear(mlp_ratio * dim, dim)
        )

    def forward(self, x, key_mask, prefix_kv=None):
        x = x + self.attn(self.norm1(x), key_mask, prefix_kv)
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        d, grid = cfg.hidden, cfg.image_size // cfg.patch_size
        self.grid, self.shuffle = grid, cfg.pixel_shuffle
        self.patch = nn.Conv2d(3, d, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.pos = nn.Parameter(torch.randn(1, grid * grid, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.vision_layers))
        self.proj = nn.Linear(d * self.shuffle**2, d)

    def forward(self, images):  # (N, 3, H, W) -> (N, tokens_per_image, d)
        x = self.patch(images).flatten(2).transpose(1, 2) + self.pos
        ones = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
        for blk in self.blocks:
            x = blk(x, ones)
        if self.shuffle > 1:  # SmolVLM pixel shuffle: fold s x s neighbourhoods into channels
            n, _, d = x.shape
            s, g = self.shuffle, self.grid
            x = x.view(n, g // s, s, g // s, s, d).permute(0, 1, 3, 2, 4, 5).reshape(n, (g // s) ** 2, s * s * d)
        return self.proj(x)


class VlmStage(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden
        self.vision = VisionEncoder(cfg)
        self.embed = nn.Embedding(VOCAB_SIZE, d)
        self.state_proj = nn.Linear(cfg.state_dim, d) if cfg.state_in_prefix else None
        self.blocks = nn.ModuleList(Block(d, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.lm_layers))
        self.norm = nn.RMSNorm(d)

    def forward(self, images, image_mask, tokens, token_mask, state):
        b, cams = images.shape[:2]
        img = self.vision(images.flatten(0, 1)).view(b, cams * self.cfg.tokens_per_image, -1)
        img_mask = image_mask.repeat_interleave(self.cfg.tokens_per_image, dim=1)
        parts = [img, self.embed(tokens) * math.sqrt(self.cfg.hidden)]
        masks = [img_mask, token_mask]
        if self.state_proj is not None:
            parts.append(self.state_proj(state)[:, None, :])
            masks.append(torch.ones(b, 1, dtype=torch.bool, device=state.device))
        x, mask = torch.cat(parts, dim=1), torch.cat(masks, dim=1)
        for blk in self.blocks:
            x = blk(x, mask)
        return self.norm(x), mask


def _time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of the flow time t in [0, 1] (pi0 uses the same construction)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=t.dtype) / half)
    ang = t[:, None] * freqs[None, :] * 1000.0
    return torch.cat([ang.sin(), ang.cos()], dim=-1)


class AditStage(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.cfg = cfg
        e = cfg.expert_hidden
        self.action_in = nn.Linear(cfg.model_action_dim, e)
        self.time_mlp = nn.Sequential(nn.Linear(2 * e, e), nn.SiLU(), nn.Linear(e, e))
        self.state_in = None if cfg.state_in_prefix else nn.Linear(cfg.state_dim, e)
        self.prefix_kv = nn.ModuleList(nn.Linear(cfg.hidden, 2 * e) for _ in range(cfg.expert_layers))
        self.blocks = nn.ModuleList(Block(e, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.expert_layers))
        self.norm = nn.RMSNorm(e)
        self.action_out = nn.Linear(e, cfg.model_action_dim)

    def cache_prefix(self, prefix):
        """Per-layer keys/values of the prefix, computed once and reused by every denoising step."""
        b, p, _ = prefix.shape
        heads, hd = self.cfg.heads, self.cfg.expert_hidden // self.cfg.heads
        cache = []
        for proj in self.prefix_kv:
            k, v = proj(prefix).view(b, p, 2, heads, hd).permute(2, 0, 3, 1, 4)
            cache.append((k, v))
        return cache

    def velocity(self, x_t, t, kv_cache, key_mask, state):
        h = self.action_in(x_t)
        te = _time_embedding(t, self.cfg.expert_hidden)[:, None, :].expand_as(h)
        h = self.time_mlp(torch.cat([h, te], dim=-1))
        if self.state_in is not None:
            h = torch.cat([self.state_in(state)[:, None, :], h], dim=1)
        for blk, kv in zip(self.blocks, kv_cache, strict=True):
            h = blk(h, key_mask, kv)
        return self.action_out(self.norm(h[:, -self.cfg.action_horizon :]))

    def forward(self, prefix, prefix_mask, state, noise):
        b = noise.shape[0]
        kv = self.cache_prefix(prefix)
        n_suffix = self.cfg.action_horizon + (0 if self.state_in is None else 1)
        key_mask = torch.cat([prefix_mask, torch.ones(b, n_suffix, dtype=torch.bool, device=noise.device)], dim=1)
        # Flow matching as in pi0: t runs from 1 (noise) to 0 (actions), Euler steps of -1/N.
        x, dt = noise, -1.0 / self.cfg.denoise_steps
        t = torch.ones(b, device=noise.device, dtype=noise.dtype)
        for _ in range(self.cfg.denoise_steps):
            x = x + dt * self.velocity(x, t, kv, key_mask, state)
            t = t + dt
        return x


def _stack_padded(rows: list[torch.Tensor], padded: int, pad_row: torch.Tensor | None = None) -> torch.Tensor:
    """Stack per-request rows into a fixed-size batch; pad rows are copies of `pad_row` (or zeros)."""
    if padded < len(rows):
        raise ValueError(f"batch of {len(rows)} does not fit padded size {padded}")
    fill = pad_row if pad_row is not None else torch.zeros_like(rows[0])
    return torch.stack(rows + [fill] * (padded - len(rows)))


class VlaPolicy:
    """A served model: both stages, input preparation and batched stage runs."""

    def __init__(self, spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.spec, self.cfg = spec, spec.arch_config
        self.device, self.dtype = torch.device(device), dtype
        with torch.random.fork_rng(devices=[]):  # build from the variant seed without touching global RNG
            torch.manual_seed(1_000_003 * (1 + hash_name(spec.arch)) + spec.seed)
            self.vlm = VlmStage(self.cfg)
            self.adit = AditStage(self.cfg)
        for m in (self.vlm, self.adit):
            m.to(device=self.device, dtype=dtype).eval().requires_grad_(False)

    # ---- inputs ----
    def prepare(self, obs: Observation) -> PolicyInputs:
        cfg = self.cfg
        if len(obs.images) > cfg.cameras:
            raise ValueError(f"{self.spec.name} takes at most {cfg.cameras} images, got {len(obs.images)}")
        images = torch.zeros(cfg.cameras, 3, cfg.image_size, cfg.image_size)
        image_mask = torch.zeros(cfg.cameras, dtype=torch.bool)
        for i, img in enumerate(obs.images):
            images[i] = (
                torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).float() / 127.5 - 1.0
            )  # copy: wire buffers are read-only
            image_mask[i] = True
        tokens, token_mask = tokenize(obs.prompt, cfg.max_text_tokens)
        gen = torch.Generator().manual_seed(int(obs.noise_seed))
        noise = torch.randn(cfg.action_horizon, cfg.model_action_dim, generator=gen)
        state = torch.from_numpy(np.array(obs.state, dtype=np.float32))
        return PolicyInputs(images, image_mask, torch.from_numpy(tokens), torch.from_numpy(token_mask), state, noise)

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, dtype=self.dtype if t.is_floating_point() else t.dtype, non_blocking=True)

    # ---- stages ----
    @torch.inference_mode()
    def run_vlm(self, batch: list[PolicyInputs], padded: int) -> list[PrefixState]:
        first_token_only = torch.zeros_like(batch[0].token_mask)
        first_token_only[0] = True  # pad rows attend to one token so that they stay finite
        images = self._to(_stack_padded([b.images for b in batch], padded))
        image_mask = self._to(_stack_padded([b.image_mask for b in batch], padded))
        tokens = self._to(_stack_padded([b.tokens for b in batch], padded))
        token_mask = self._to(_stack_padded([b.token_mask for b in batch], padded, first_token_only))
        state = self._to(_stack_padded([b.state for b in batch], padded))
        feats, mask = self.vlm(images, image_mask, tokens, token_mask, state)
        return [PrefixState(feats[i], mask[i]) for i in range(len(batch))]

    @torch.inference_mode()
    def run_adit(self, prefixes: list[PrefixState], batch: list[PolicyInputs], padded: int) -> list[np.ndarray]:
        prefix = _stack_padded([p.features for p in prefixes], padded)
        mask = _stack_padded([p.mask for p in prefixes], padded, prefixes[0].mask)
        state = self._to(_stack_padded([b.state for b in batch], padded))
        noise = self._to(_stack_padded([b.noise for b in batch], padded))
        actions = self.adit(prefix, mask, state, noise)[: len(batch), :, : self.cfg.output_action_dim]
        out = actions.float().cpu().numpy()
        return [out[i] for i in range(len(batch))]

    def infer(self, obs: Observation) -> np.ndarray:
        """Both stages for one observation (reference path for tests and the profiler)."""
        inputs = self.prepare(obs)
        return self.run_adit(self.run_vlm([inputs], 1), [inputs], 1)[0]


def hash_name(name: str) -> int:
    """A stable (process-independent) small hash; Python's hash() is salted per process."""
    return sum((i + 1) * b for i, b in enumerate(name.encode())) % 100_003


def example_observation(seed: int = 0, prompt: str = "put the bowl on the plate", cameras: int = 2) -> Observation:
    """A LIBERO-style observation with random content (two 224x224 images, 8-d state)."""
    rng = np.random.default_rng(seed)
    images = [rng.integers(0, 256, size=(224, 224, 3), dtype=np.uint8) for _ in range(cameras)]
    return Observation(images, rng.standard_normal(8).astype(np.float32), prompt, noise_seed=seed)
