"""This machine's measured cost models on disk, and the cost model recovery plans with.

bench/calibration.py measures a CostModel (it runs the engine, so it sits above it) and stores
it here; the engine reads it at plan time (it sits below the engine, so the engine never imports
the calibration harness). The cache is one JSON file, $OW_CACHE_DIR/recovery-costs.json (default
~/.cache/orbitweaver), keyed by the model's content hash, the machine (processor, cores, torch
version and threads, device), the dtype and the filesystem of the scratch directory whose read
bandwidth was measured (docs/recovery.md §6).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import replace

from common import machine

from .cost import ORIN_AGX_NVME, REFERENCE_CHUNK, CostModel, ModelDims, TargetDevice, model_bytes

_cache_lock = threading.Lock()


def cache_dir() -> str:
    return os.environ.get("OW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "orbitweaver")


def _cache_path() -> str:
    return os.path.join(cache_dir(), "recovery-costs.json")


def machine_identity(device: str) -> dict:
    return {"cpu": machine.cpu_model(), "cpus": machine.cpu_count(), **machine.torch_details(device)}


def calibration_key(model_hash: str, device: str, dtype: str, scratch_dir: str) -> str:
    ident = {
        "model": model_hash,
        "dtype": dtype,
        "scratch_dev": os.stat(scratch_dir).st_dev,
        **machine_identity(device),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]


def model_key(model, scratch_dir: str) -> str:
    """The cache key of a loaded model on this machine, measured on `scratch_dir`'s filesystem."""
    dtype_name = str(model.dtype).removeprefix("torch.")
    return calibration_key(model.content_hash, model.device.type, dtype_name, scratch_dir)


def load_cache() -> dict:
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def store(key: str, value: dict) -> None:
    path = _cache_path()
    with _cache_lock:
        cache = load_cache()
        cache[key] = value
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(cache, f, indent=1)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs a re-calibration next time


def cached(key: str) -> CostModel | None:
    hit = load_cache().get(key)
    return CostModel.from_json(hit) if hit is not None else None


def cost_model_for(
    model,
    *,
    emulate: TargetDevice | None = None,
    group: int = 4,
    chunk: int = REFERENCE_CHUNK,
    scratch_dir: str | None = None,
    native: CostModel | None = None,
) -> CostModel:
    """The CostModel recovery should plan with for a loaded model, without delaying a boot: the
    cached calibration of this model on this machine (or `native`, a calibration in hand) if
    there is one, else the model's byte counts at the target device's rates. With `emulate`, the
    target-emulated version (reads throttled to the target's read-to-compute ratio). Never
    measures: calibrate first (bench.calibration.calibrate) to plan with this machine's rates."""
    scratch_dir = scratch_dir or tempfile.gettempdir()
    key = model_key(model, scratch_dir)
    if native is None:
        native = cached(key)
    dims = ModelDims.from_text_config(model.adapter.text_config, dtype_bytes=model.dtype.itemsize)
    if native is None:
        target_model = replace(CostModel.for_target(dims, emulate or ORIN_AGX_NVME), **model_bytes(model))
        return replace(target_model, label="uncalibrated:" + target_model.label)
    if emulate is None:
        return native
    return native.target_emulated(replace(CostModel.for_target(dims, emulate), **model_bytes(model)), group, chunk)
