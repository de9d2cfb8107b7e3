"""Lazy, per-module weight loading from a model directory's safetensors files.

The model skeleton is built on the meta device (no memory, no init); each module's parameters
are read from disk only when it is first needed, so after a reboot the engine can compute
layer 0 while layer 27 is still being read. A background thread may prefetch in the order a
recovery plan needs them; `ensure()` blocks until a module is resident, loading it itself if the
prefetcher has not got there yet. Either way the tensors are the file's bytes, cast exactly as
`from_pretrained(dtype=...)` casts them.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from common.record import crc32c, tensor_bytes

from .config import ModelError, weight_files  # noqa: F401  (weight_files: re-exported)

# Checkpoints written by older transformers releases keep the language model at `model.` and the
# vision tower at `visual.`; current classes nest both under `model.`.
_LEGACY_KEY_RULES = [
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!visual\.|language_model\.)"), "model.language_model."),
]


def normalize_key(key: str) -> str:
    for pattern, repl in _LEGACY_KEY_RULES:
        if pattern.match(key):
            return pattern.sub(repl, key, count=1)
    return key


@dataclass
class LoadStats:
    bytes_read: int = 0
    seconds: float = 0.0
    modules: int = 0


class WeightStore:
    """Maps parameter names to safetensors entries and materialises modules on demand."""

    def __init__(
        self,
        model: nn.Module,
        model_dir: str,
        dtype: torch.dtype,
        device: torch.device,
        tied: dict[str, str] | None = None,
        read_hook=None,
    ):
        self.model = model
        self.dtype = dtype
        self.device = device
        self.tied = dict(tied or {})
        self.read_hook = read_hook  # called with the bytes read (storage bandwidth emulation)
        self.stats = LoadStats()
        self._where: dict[str, tuple[str, str]] = {}
        for path in weight_files(model_dir):
            try:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        self._where[normalize_key(key)] = (path, key)
            except SafetensorError as exc:  # what check_weight_file does not look at (dtypes, shapes)
                raise ModelError(f"weight file {path} is not a usable safetensors file: {exc}") from None
        if not self._where:
            raise FileNotFoundError(f"no safetensors weights in {model_dir}")
        self._loaded: set[str] = set()
        self._loading: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._handles: dict[str, Any] = {}  # safetensors' safe_open handles
        self._prefetch: threading.Thread | None = None
        self._stop = False

    # -- public API -------------------------------------------------------------------------
    def ensure(self, *prefixes: str) -> None:
        """Make the modules at these dotted paths resident (blocking)."""
        for prefix in prefixes:
            self._load(prefix)

    def prefetch(self, prefixes: list[str]) -> None:
        """Load these modules in order on a background thread."""
        self.stop_prefetch()
        self._stop = False

        def run():
            for p in prefixes:
                if self._stop:
                    return
                self._load(p)

        self._prefetch = threading.Thread(target=run, name="weight-prefetch", daemon=True)
        self._prefetch.start()

    def stop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._stop = True
            self._prefetch.join()
            self._prefetch = None

    def module_nbytes(self, prefix: str) -> int:
        module = self.model.get_submodule(prefix)
        return sum(p.numel() * self.dtype.itemsize for p in module.parameters(recurse=True))

    def missing_keys(self) -> list[str]:
        """Parameters of the model with no tensor in the files (and not tied)."""
        names = [n for n, _ in self.model.named_parameters()]
        return [n for n in names if n not in self._where and n not in self.tied]

    # -- internals --------------------------------------------------------------------------
    def _load(self, prefix: str) -> None:
        with self._lock:
            if prefix in self._loaded:
                return
            event = self._loading.get(prefix)
            owner = event is None
            if event is None:
                event = self._loading[prefix] = threading.Event()
        if not owner:
            event.wait()
            return
        try:
            self._materialise(prefix)
            with self._lock:
                self._loaded.add(prefix)
        finally:
            event.set()
            with self._lock:
                self._loading.pop(prefix, None)

    def _tensor(self, name: str) -> torch.Tensor:
        source = self.tied.get(name, name) if name not in self._where else name
        path, key = self._where[source]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt")
        # A view of the file's pages (mmap), kept as is when no cast is needed -- exactly what
        # from_pretrained does. That matters for bits: CPU GEMM kernels take different paths for
        # differently aligned operands, so a copy (64-byte aligned) of a weight that sits at an
        # odd offset in the file gives different logits than the mapped original.
        t = handle.get_tensor(key)
        nbytes = t.numel() * t.element_size()
        crc32c(tensor_bytes(t))  # touch every page now: the read happens here, not mid-compute
        self.stats.bytes_read += nbytes
        if self.read_hook:
            self.read_hook(nbytes)
        if t.is_floating_point() and t.dtype != self.dtype:
            t = t.to(self.dtype)
        return t.to(self.device) if self.device.type != "cpu" else t

    def _materialise(self, prefix: str) -> None:
        start = time.perf_counter()
        module = self.model.get_submodule(prefix)
        state = {}
        for name, _param in module.named_parameters(recurse=True):
            full = f"{prefix}.{name}"
            if full not in self._where and self.tied.get(full) not in self._where:
                raise KeyError(f"weight {full} not found in the model files")
            state[name] = self._tensor(full)
        module.load_state_dict(state, strict=False, assign=True)
        # Non-persistent buffers (rotary inverse frequencies) are not in the files: rebuild the
        # module that owns them on the real device, exactly as its constructor computes them.
        for _child_name, child in list(module.named_modules()):
            if any(b.is_meta for b in child.buffers(recurse=False)):
                rebuilt = _rebuild_buffers(child, self.device)
                for bname, buf in rebuilt.items():
                    setattr(child, bname, buf)
        self.stats.seconds += time.perf_counter() - start
        self.stats.modules += 1


def _rebuild_buffers(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    config = getattr(module, "config", None)
    if config is None:
        raise RuntimeError(f"cannot rebuild buffers of {type(module).__name__}: no config")
    with torch.device(device):
        fresh = type(module)(config)
    return {name: buf for name, buf in fresh.named_buffers(recurse=False)}
