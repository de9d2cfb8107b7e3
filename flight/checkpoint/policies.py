"""Checkpoint policies: what to persist, when. One engine runs them all, so comparisons are fair.

A policy answers a few questions the engine asks at each unit of work; it never touches tensors
or files itself. The engine (flight/engine.py) hands the chosen state to the store, and recovery
(flight/recovery/) restores whatever records the policy left.

    orbitweaver   vision state every k blocks (A/B buffers) + the vision output; prefill blocks of
                  G layers x C tokens holding KV and the group's boundary hidden state; one decode
                  record every D steps.
    none          no checkpoints (the request restarts after a cut); only MANIFEST and RESULT.

Baselines (docs/baselines.md) are further subclasses choosing other answers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Geometry:
    """Units of work and of persistence."""

    chunk: int = 1024        # C: prompt tokens per prefill chunk (changes the bits: pinned in MANIFEST)
    group: int = 4           # G: decoder layers per prefill block
    decode_every: int = 16   # D: decode steps per decode record
    vision_every: int = 4    # k: vision blocks between vision checkpoints

    def __post_init__(self):
        for name in ("chunk", "group", "decode_every", "vision_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1")

    def layer_groups(self, num_layers: int) -> list[tuple[int, int]]:
        return [(l0, min(num_layers, l0 + self.group)) for l0 in range(0, num_layers, self.group)]

    def token_chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        return [(s, min(num_tokens, s + self.chunk)) for s in range(0, num_tokens, self.chunk)]


@dataclass(frozen=True)
class PrefillPersist:
    kv: bool
    boundary_hidden: bool


class Policy:
    name = "abstract"
    description = ""

    def geometry(self, requested: Geometry, num_layers: int) -> Geometry:
        """The geometry this policy runs with (baselines fix G, for example)."""
        return requested

    def writes_checkpoints(self) -> bool:
        return True

    def vision_state_due(self, blocks_done: int, total: int, geometry: Geometry) -> bool:
        """Persist the vision hidden state after `blocks_done` blocks?"""
        return blocks_done < total and blocks_done % geometry.vision_every == 0

    def persist_vision_out(self) -> bool:
        return True

    def prefill_block(self, group: int, chunk: int, num_groups: int, num_chunks: int) -> PrefillPersist | None:
        """What to persist when prefill block (group, chunk) completes; None = nothing."""
        return PrefillPersist(kv=True, boundary_hidden=True)

    def layer_input_hidden(self) -> bool:
        """Persist every layer's input hidden state per chunk (HCache-style restore)."""
        return False

    def decode_record_due(self, steps_since_record: int, geometry: Geometry, finished: bool) -> bool:
        return steps_since_record >= geometry.decode_every or (finished and steps_since_record > 0)


class OrbitWeaverPolicy(Policy):
    name = "orbitweaver"
    description = ("phase-aware: vision state every k blocks, prefill blocks of G layers x C tokens "
                   "(KV + boundary hidden), decode record every D steps")


class NoCheckpointPolicy(Policy):
    name = "none"
    description = "no checkpoints: a cut restarts the request from the beginning"

    def writes_checkpoints(self) -> bool:
        return False

    def vision_state_due(self, blocks_done, total, geometry):
        return False

    def persist_vision_out(self):
        return False

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        return None

    def decode_record_due(self, steps_since_record, geometry, finished):
        return False


class SonicLayerPolicy(Policy):
    """SONIC-style layer-wise checkpointing: everything after every unit (finest progress, most bytes)."""

    name = "sonic-layer"
    description = "after every layer of every chunk: KV + hidden state; every vision block; every decode step"

    def geometry(self, requested, num_layers):
        return replace(requested, group=1, vision_every=1, decode_every=1)


class SonicChunkPolicy(Policy):
    """SONIC-style chunk-wise checkpointing: all layers' KV once a whole chunk is through."""

    name = "sonic-chunk"
    description = "after each whole chunk: KV of all layers (least bytes, most recomputation); vision output only"

    def geometry(self, requested, num_layers):
        return replace(requested, group=num_layers)

    def vision_state_due(self, blocks_done, total, geometry):
        return False

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        # The final hidden state is kept for the last chunk only: the first token needs it.
        return PrefillPersist(kv=True, boundary_hidden=chunk == num_chunks - 1)


class HCachePolicy(Policy):
    """HCache-style: per-layer hidden states instead of KV for a share of the layers; their KV is
    re-projected at restore time while the other layers' KV is read (HCache, EuroSys'25)."""

    name = "hcache"
    description = ("per layer and chunk: the hidden state for re-projected layers (KV rebuilt by re-projection), "
                   "KV for the others, split so re-projection and reading overlap")
    #: Every `reproject_every`-th layer's KV is re-projected from its input hidden state. HCache
    #: picks the split that balances re-projection compute against reading the remaining KV
    #: ("bubble-free"); for Qwen-VL GQA layers both take about the same time per layer on the
    #: payload computers we target, hence one layer in two (docs/baselines.md).
    reproject_every = 2

    def geometry(self, requested, num_layers):
        return replace(requested, group=1)

    def reprojected(self, layer: int) -> bool:
        return layer % self.reproject_every == self.reproject_every - 1

    def prefill_block(self, group, chunk, num_groups, num_chunks):
        # Block = layer here (G = 1). Store the hidden state a re-projected next layer needs as its
        # input, KV only for the layers that are not re-projected.
        keep_hidden = self.reprojected(group + 1) or (group == num_groups - 1 and chunk == num_chunks - 1)
        return PrefillPersist(kv=not self.reprojected(group), boundary_hidden=keep_hidden)


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (OrbitWeaverPolicy, NoCheckpointPolicy, SonicLayerPolicy,
                                                               SonicChunkPolicy, HCachePolicy)}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None


__all__ = ["Geometry", "PrefillPersist", "Policy", "OrbitWeaverPolicy", "NoCheckpointPolicy", "SonicLayerPolicy",
           "SonicChunkPolicy", "HCachePolicy", "POLICIES", "get_policy", "register", "replace"]
