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


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (OrbitWeaverPolicy, NoCheckpointPolicy)}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None


__all__ = ["Geometry", "PrefillPersist", "Policy", "OrbitWeaverPolicy", "NoCheckpointPolicy", "POLICIES",
           "get_policy", "register", "replace"]
