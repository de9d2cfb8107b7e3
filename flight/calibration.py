"""Calibration: this machine's recovery costs, measured with the real record reader and engine.

Above the engine (it runs `Engine` on real blocks), so that the cost model the engine plans with
(flight/recovery/cost.py) imports no engine. A measured CostModel is kept in the calibration
cache (flight/recovery/calibration_cache.py), where the engine finds it at plan time
(docs/recovery.md §6).

    calibrate()   measure (or take from the cache) this machine's CostModel for a model; then
                  flight.recovery.calibration_cache.cost_model_for(model) plans with it
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
from scipy.optimize import nnls
from scipy.stats import theilslopes

from common.durable import DurableFS
from common.record import Kind, encode, read_partial
from flight.checkpoint.policies import Geometry
from flight.engine import Engine, EngineOptions
from flight.model.inputs import build_inputs
from flight.model.loader import load_model
from flight.model.tiny import vocabulary
from flight.recovery import calibration_cache
from flight.recovery.cost import CostModel, ModelDims, model_bytes


def _drop_page_cache(path: str) -> None:
    """After fsync the pages are clean: ask the kernel to drop them so the timed read goes to the
    device, as the first read after a power cut does. (No effect on tmpfs: RAM is the device.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_reads(scratch_dir: str, sizes_mib=(1, 2, 4, 8, 16), repeats: int = 3) -> tuple[float, float, list]:
    """(bytes/s, seconds per read, samples): write checkpoint records of several sizes with the
    durable writer, drop them from the page cache, read them back with the record reader (header,
    commit footer, per-tensor CRC, exactly as recovery does) and fit time = latency + bytes/bw.
    Shared disks are noisy (single reads vary 3x here), so the fit is Theil-Sen (median slopes)."""
    fs = DurableFS()
    samples = []
    with tempfile.TemporaryDirectory(prefix="ow-calib-", dir=scratch_dir) as tmp:
        paths = []
        for i, mib in enumerate(sizes_mib):
            t = torch.randint(-128, 127, (mib << 20,), dtype=torch.int8)
            path = os.path.join(tmp, f"r{i}.blk")
            fs.write_atomic(path, encode(Kind.PREFILL_BLOCK, {"group": 0, "chunk": i}, {"k.0": t}).chunks)
            paths.append((path, mib << 20))
        for _ in range(repeats):
            for path, nbytes in paths:
                _drop_page_cache(path)
                start = time.perf_counter()
                with fs.open_read(path) as f:
                    read_partial(f, {"k.0"}, os.fstat(f.fileno()).st_size)
                samples.append((nbytes, time.perf_counter() - start))
    nbytes, secs = np.array([n for n, _ in samples], float), np.array([t for _, t in samples])
    inv_bw, latency = theilslopes(secs, nbytes)[:2]
    if inv_bw <= 0:  # no usable slope: attribute everything to bandwidth
        inv_bw, latency = secs.sum() / nbytes.sum(), 0.0
    return float(1.0 / inv_bw), float(max(latency, 0.0)), samples


def _block_stamper(stamps: list[tuple[int, int, float]]) -> Callable[..., None]:
    """Engine events that append (group, chunk, time) at the end of each prefill block."""

    def events(name: str, **fields: Any) -> None:
        if name == "prefill_block_done":
            stamps.append((fields["group"], fields["chunk"], time.perf_counter()))

    return events


def measure_compute(
    model, group: int, dims: ModelDims, chunk_sizes=(16, 48), chunks: float = 3.5, repeats: int = 2
) -> tuple[float, float, list]:
    """(seconds per layer call, seconds per FLOP, samples) from real blocks run by the engine.

    A text-only prompt of `chunks` x C tokens is prefilled by `Engine` (no checkpoints) for each
    chunk size C; the time between consecutive `prefill_block_done` events is one block's compute.
    Chunk 0 is left out (it includes the lazy weight loads). Block time is fitted as
        layers * (call + FLOPs per layer / rate)        (non-negative least squares)
    with attention FLOPs counted per (query, key) pair: prompts short enough to calibrate in
    seconds cannot separate attention from the projections, so both run at the measured rate."""
    words = [w for w in vocabulary() if w.isalpha()]
    samples = []
    for chunk in chunk_sizes:
        target_tokens = int(chunks * chunk)
        prompt = " ".join(words[i % len(words)] for i in range(target_tokens))
        inputs = build_inputs(model.tokenizer, model.image_processor, [], prompt, model.adapter.image_token_id)
        # The chat template adds a few tokens: trim the prompt until the request has the length.
        while inputs.num_tokens > target_tokens and prompt:
            prompt = prompt.rsplit(" ", 1)[0]
            inputs = build_inputs(model.tokenizer, model.image_processor, [], prompt, model.adapter.image_token_id)
        geometry = Geometry(chunk=chunk, group=group)
        groups = geometry.layer_groups(model.adapter.num_layers)
        spans = geometry.token_chunks(inputs.num_tokens)
        for _ in range(repeats):
            stamps: list[tuple[int, int, float]] = []
            engine = Engine(
                model,
                EngineOptions(geometry=geometry, policy="none", async_writes=False),
                events=_block_stamper(stamps),
            )
            with tempfile.TemporaryDirectory(prefix="ow-calib-") as ckpt:
                engine.run(inputs, ckpt, max_new_tokens=1)
            for (g0, c0, t0), (g, c, t) in itertools.pairwise(stamps):
                if c == 0 or (g, c) == (g0, c0):
                    continue
                (l0, l1), (s, e) = groups[g], spans[c]
                samples.append((l1 - l0, e - s, s, t - t0))

    def flops(tokens, start):
        pairs = tokens * start + tokens * (tokens + 1) / 2
        return tokens * dims.flops_per_token_layer + pairs * dims.flops_per_pair_layer

    feats = np.array([[L, L * flops(T, s)] for L, T, s, _ in samples])
    scale = feats.max(axis=0)
    coef, _ = nnls(feats / scale, np.array([x[3] for x in samples]))
    call_s, s_per_flop = coef / scale
    return float(call_s), float(s_per_flop), samples


def calibrate(
    model_dir: str | None = None,
    *,
    model=None,
    group: int = 2,
    device: str = "cpu",
    dtype: str | None = None,
    scratch_dir: str | None = None,
    use_cache: bool = True,
) -> CostModel:
    """Measure this machine's CostModel for a model (a directory, or an already loaded model).

    Cached as JSON in $OW_CACHE_DIR/recovery-costs.json (default ~/.cache/orbitweaver), keyed by
    the model's content hash, the CPU model and count, torch version and threads, the device, the
    dtype and the filesystem of `scratch_dir` -- put that on the checkpoint device, since its read
    bandwidth is what is measured (default: the system temp directory). A few seconds on the tiny
    and small models; instant when cached."""
    if model is None:
        if model_dir is None:
            raise ValueError("calibrate needs a model directory or a loaded model")
        model = load_model(model_dir, device=device, dtype=dtype)
    scratch_dir = scratch_dir or tempfile.gettempdir()
    dtype_name = str(model.dtype).removeprefix("torch.")
    key = calibration_cache.model_key(model, scratch_dir)
    if use_cache:
        hit = calibration_cache.cached(key)
        if hit is not None:
            return hit
    t0 = time.perf_counter()
    dims = ModelDims.from_text_config(
        model.adapter.text_config, name=os.path.basename(model.model_dir), dtype_bytes=model.dtype.itemsize
    )
    bw, latency, read_samples = measure_reads(scratch_dir)
    call_s, s_per_flop, compute_samples = measure_compute(model, group, dims)
    measured = CostModel(
        **model_bytes(model),
        read_bytes_per_s=bw,
        read_latency_s=latency,
        layer_call_s=call_s,
        token_layer_s=s_per_flop * dims.flops_per_token_layer,
        pair_layer_s=s_per_flop * dims.flops_per_pair_layer,
        reproject_share=dims.reproject_share,
        label="native",
        meta={
            "key": key,
            "model_hash": model.content_hash,
            "dims": asdict(dims),
            "machine": calibration_cache.machine_identity(model.device.type),
            "dtype": dtype_name,
            "flops_per_s": 1.0 / s_per_flop if s_per_flop > 0 else None,
            "read_samples": len(read_samples),
            "compute_samples": len(compute_samples),
            "seconds": round(time.perf_counter() - t0, 3),
        },
    )
    calibration_cache.store(key, measured.to_json())
    return measured
