"""Helpers shared by test folders (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import socket

import numpy as np
import torch
from PIL import Image

from bench.farm_bench import short_trace  # noqa: F401  (the campaign and bench farm tests fly it)
from flight.checkpoint.policies import Geometry
from flight.engine import Engine, EngineOptions, SimulatedCut
from flight.model.inputs import build_inputs
from flight.model.loader import load_model

ARCHS = ["qwen3-vl", "qwen2.5-vl"]


def make_images(seed: int = 0):
    """Two small, different pictures (a noisy gradient and pure noise), deterministic."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, 128 * 96 * 3).reshape(96, 128, 3)
    first = (base + rng.normal(0, 30, base.shape)).clip(0, 255).astype(np.uint8)
    second = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
    return [Image.fromarray(first), Image.fromarray(second)]


PROMPT = (
    "describe the clouds over the coast and count the ships in the harbor , then compare the two "
    "images and report any new damage to the bridge near the river"
)
# Small chunks and groups so that even a tiny prompt spans a grid of prefill blocks.
GEOMETRY = Geometry(chunk=16, group=2, decode_every=2, vision_every=1)
MAX_NEW = 10


def inputs_for(model, images=None, prompt=PROMPT):
    images = make_images() if images is None else images
    return build_inputs(model.tokenizer, model.image_processor, images, prompt, model.adapter.image_token_id)


def engine(model, geometry=GEOMETRY, policy="orbitweaver", **kw):
    kw.setdefault("async_writes", False)
    events = kw.pop("events", None)
    after_commit = kw.pop("after_commit", None)
    fs = kw.pop("fs", None)
    return Engine(
        model, EngineOptions(geometry=geometry, policy=policy, **kw), fs=fs, events=events, after_commit=after_commit
    )


def reference(model_dir: str, inputs, max_new_tokens: int, chunk: int | None):
    """Tokens and per-step logits from transformers' own generate(), greedy."""
    import transformers

    ref = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    has_images = inputs.image_grid_thw.shape[0] > 0
    kw = dict(
        input_ids=inputs.input_ids,
        attention_mask=torch.ones_like(inputs.input_ids),
        image_grid_thw=inputs.image_grid_thw if has_images else None,
        mm_token_type_ids=inputs.mm_token_type_ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        if not has_images:
            out = ref.generate(**kw, prefill_chunk_size=chunk if chunk and chunk < inputs.num_tokens else None)
        elif chunk is None or chunk >= inputs.num_tokens:
            out = ref.generate(pixel_values=inputs.pixel_values, **kw)
        else:
            enc = ref.model.get_image_features(inputs.pixel_values, inputs.image_grid_thw, return_dict=True)
            out = ref.generate(mm_encoder_outputs={"image": enc}, prefill_chunk_size=chunk, **kw)
    tokens = out.sequences[0, inputs.num_tokens :].tolist()
    return tokens, [step_logits[0] for step_logits in out.logits]


class CutAfter:
    """Events/commit hook raising SimulatedCut at the n-th matching occurrence (a power cut)."""

    UNITS = ("vision_block_done", "prefill_block_done", "decode_step_done")

    def __init__(self, n: int, names=UNITS):
        self.n, self.names, self.seen, self.last = n, names, 0, None

    def event(self, name, **fields):
        if name in self.names:
            self.seen += 1
            self.last = (name, fields)
            if self.seen == self.n:
                raise SimulatedCut(f"cut after {name} {fields}")

    def commit(self, what, nbytes):
        self.seen += 1
        self.last = (what, nbytes)
        if self.seen == self.n:
            raise SimulatedCut(f"cut after commit of {what}")


def run_to_completion(model_dir, inputs, ckpt, max_new=MAX_NEW, geometry=GEOMETRY, policy="orbitweaver", **kw):
    """A fresh process lifetime: load the model anew, run (or resume) the request."""
    model = load_model(model_dir, device="cpu")
    return engine(model, geometry, policy, **kw).run(inputs, str(ckpt), max_new)


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free a moment ago (all held at once while they are picked, so
    they differ), for processes that must be told their ports before they start."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


#: How long a test waits for a condition before it calls the wait a hang. Waits end as soon as
#: their condition holds; this deadline only turns a hang into a failure that names what was
#: awaited, and a stalled 2-core machine may take many times the usual seconds.
HANG_S = 300.0
