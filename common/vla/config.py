"""Model architectures and the model catalogue.

An `ArchConfig` describes one VLA architecture twice over:
  * the *shapes* that matter for serving and are public facts (image size, cameras, tokens per
    image, action horizon, denoising steps, action dimension), which the tiny random model keeps;
  * tiny *widths and depths* so that the real torch model runs in milliseconds on a CPU.
The public-scale sizes used to derive GPU latency profiles live in `analytic.py`.

A `ModelSpec` is one served model: an architecture plus a variant seed (fine-tuned variants of
one architecture share its latency profile, as in the paper §4.1.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ArchConfig:
    name: str
    # --- public shapes (kept by the tiny model) ---
    image_size: int  # input images are image_size x image_size RGB
    cameras: int  # camera slots the model embeds; missing cameras are masked (openpi LIBERO does this)
    patch_size: int
    pixel_shuffle: int  # SmolVLM-style token reduction: (grid/shuffle)^2 tokens per image
    max_text_tokens: int
    state_dim: int  # robot state fed to the model (LIBERO: 8)
    state_in_prefix: bool  # SmolVLA projects state into the VLM prefix; pi0 feeds it to the action expert
    action_horizon: int  # actions per chunk
    model_action_dim: int  # internal action width (pi0 pads to 32)
    output_action_dim: int  # dimensions returned to the robot (LIBERO: 7)
    denoise_steps: int  # flow-matching Euler steps of the action expert
    # --- tiny widths/depths (random weights) ---
    vision_layers: int = 2
    lm_layers: int = 2
    expert_layers: int = 2
    hidden: int = 64
    expert_hidden: int = 48
    heads: int = 4
    mlp_ratio: int = 2

    @property
    def tokens_per_image(self) -> int:
        grid = self.image_size // self.patch_size
        return (grid // self.pixel_shuffle) ** 2

    @property
    def prefix_tokens(self) -> int:
        return self.cameras * self.tokens_per_image + self.max_text_tokens + (1 if self.state_in_prefix else 0)

    def __post_init__(self) -> None:
        grid = self.image_size // self.patch_size
        if grid * self.patch_size != self.image_size or grid % self.pixel_shuffle:
            raise ValueError(f"{self.name}: image size, patch size and pixel shuffle do not tile")
        if not 5 <= self.denoise_steps <= 10 or not 10 <= self.action_horizon <= 50:
            # The paper's VLA class: 5-10 denoising steps, 10-50 actions per chunk.
            raise ValueError(f"{self.name}: steps/horizon outside the VLA class this scheduler targets")


# pi0 (openpi): PaliGemma (SigLIP so400m/14 at 224 px -> 256 tokens per image), 3 camera slots
# (LIBERO fills two and masks the third), 48 prompt tokens, state fed to the action expert,
# action horizon 50, 10 flow-matching steps, actions padded to 32 dims, LIBERO returns 7.
PI0 = ArchConfig(
    name="pi0",
    image_size=224,
    cameras=3,
    patch_size=14,
    pixel_shuffle=1,
    max_text_tokens=48,
    state_dim=8,
    state_in_prefix=False,
    action_horizon=50,
    model_action_dim=32,
    output_action_dim=7,
    denoise_steps=10,
)

# SmolVLA: SmolVLM2 backbone with pixel-shuffle token reduction (64 tokens per 512 px image; at
# 224 px with 16 px patches and shuffle 2 that is 49), state projected into the prefix, chunk 50,
# 10 flow-matching steps, action expert narrower than the VLM (0.75x).
SMOLVLA = ArchConfig(
    name="smolvla",
    image_size=224,
    cameras=2,
    patch_size=16,
    pixel_shuffle=2,
    max_text_tokens=48,
    state_dim=8,
    state_in_prefix=True,
    action_horizon=50,
    model_action_dim=32,
    output_action_dim=7,
    denoise_steps=10,
    hidden=64,
    expert_hidden=48,
)

ARCHS: dict[str, ArchConfig] = {a.name: a for a in (PI0, SMOLVLA)}


@dataclass(frozen=True)
class ModelSpec:
    """One served model: an architecture and a variant (its random weights' seed)."""

    name: str
    arch: str
    seed: int = 0
    description: str = field(default="", compare=False)

    @property
    def arch_config(self) -> ArchConfig:
        return ARCHS[self.arch]


def _catalogue() -> dict[str, ModelSpec]:
    models = {}
    for arch in ARCHS:
        models[arch] = ModelSpec(arch, arch, seed=0, description=f"{arch}-like base model")
        # Fine-tuned variants: same architecture and profile, different weights.
        for i in range(1, 4):
            name = f"{arch}-ft{i}"
            models[name] = ModelSpec(name, arch, seed=i, description=f"{arch}-like fine-tuned variant {i}")
    return models


MODELS: dict[str, ModelSpec] = _catalogue()

# The paper's large-scale experiment serves 8 VLA variants on a 4-GPU server.
EIGHT_MODELS: tuple[str, ...] = tuple(
    [f"pi0{s}" for s in ("", "-ft1", "-ft2", "-ft3")] + [f"smolvla{s}" for s in ("", "-ft1", "-ft2", "-ft3")]
)


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None
