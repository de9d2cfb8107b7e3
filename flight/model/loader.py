"""Open a local model directory (tiny-built or a real Qwen3-VL / Qwen2.5-VL checkpoint).

The model skeleton is created on the meta device; weights come from `WeightStore` module by
module. Tokenizer and image processor come from the same directory. The content hash pins the
exact bytes of config and weights (docs/record-format.md §4) and is cached by file size and
mtime so that it is computed once per model, not once per boot.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig, GenerationConfig

from .adapters import ADAPTERS, Adapter
from .config import MODEL_CLASSES as _MODEL_CLASSES  # noqa: F401  (re-exported)
from .config import ModelError, check_weight_files, read_model_type
from .weights import WeightStore, weight_files


def _hash_cache_path() -> str:
    root = os.environ.get("OW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "orbitweaver")
    return os.path.join(root, "model-hashes.json")


_hash_lock = threading.Lock()


def content_hash(model_dir: str) -> str:
    """sha256 over config.json and the weight files, cached by (path, size, mtime)."""
    files = [os.path.join(model_dir, "config.json")] + weight_files(model_dir)
    key = json.dumps([(os.path.realpath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in files])
    cache_path = _hash_cache_path()
    with _hash_lock:
        try:
            with open(cache_path) as f:
                cache = json.load(f)
        except (OSError, json.JSONDecodeError):
            cache = {}
        if key in cache:
            return cache[key]
        h = hashlib.sha256()
        for p in files:
            h.update(os.path.basename(p).encode())
            with open(p, "rb") as f:
                while block := f.read(8 << 20):
                    h.update(block)
        digest = h.hexdigest()
        cache[key] = digest
        try:
            os.makedirs(os.path.dirname(cache_path), exist_ok=True)
            tmp = cache_path + f".{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(cache, f)
            os.replace(tmp, cache_path)
        except OSError:
            pass  # a read-only home only costs a re-hash next time
        return digest


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Processors:
    """A model directory's tokenizer and image processor, loaded on first use (thread-safe): a
    resumed task whose inputs are stored (flight/model/inputs.py) needs neither before its last
    step, so the onboard process does not load them -- nor import their code -- on its way to
    the first unit of work."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._tokenizer = None
        self._image_processor = None

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                # lazy: transformers' tokenizer classes (about a second), on first use only
                from transformers import AutoTokenizer

                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                except Exception as exc:  # tokenizers raise many types; the user needs the one line
                    raise ModelError(f"cannot load the tokenizer from {self.model_dir}: {exc}") from None
            return self._tokenizer

    def image_processor(self):
        with self._lock:
            if self._image_processor is None:
                # lazy: transformers' tokenizer classes (about a second), on first use only
                from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

                try:
                    self._image_processor = Qwen2VLImageProcessorPil.from_pretrained(self.model_dir)
                except Exception as exc:
                    raise ModelError(f"cannot load the image-processor config from {self.model_dir}: {exc}") from None
            return self._image_processor

    def load_all(self) -> None:
        self.tokenizer()
        self.image_processor()


@dataclass
class LoadedModel:
    model_dir: str
    model_type: str
    config: object
    model: torch.nn.Module
    adapter: Adapter
    weights: WeightStore
    processors: Processors
    dtype: torch.dtype
    device: torch.device
    attn_implementation: str
    content_hash: str
    eos_token_ids: tuple[int, ...]

    @property
    def tokenizer(self):
        return self.processors.tokenizer()

    @property
    def image_processor(self):
        return self.processors.image_processor()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def resolve_dtype(config, dtype: str | None) -> torch.dtype:
    if dtype:
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ModelError(f"unknown dtype {dtype!r}")
        return resolved
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, "dtype", None) if cfg is not None else None
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    return torch.float32


def import_model_classes() -> None:
    """Import everything `load_model` resolves lazily (transformers' model, configuration,
    tokenizer and image-processor classes of every supported architecture), without reading any
    model directory: the payload's boot image (flight/runtime/preload.py)."""

    for model_type, class_name in _MODEL_CLASSES.items():
        getattr(transformers, class_name)
        transformers.models.auto.configuration_auto.CONFIG_MAPPING[model_type]


def load_model(
    model_dir: str,
    device: torch.device | str | None = None,
    dtype: str | None = None,
    attn_implementation: str = "sdpa",
    read_hook=None,
    lazy_processors: bool = False,
) -> LoadedModel:
    """Open a model directory: configuration, the model skeleton on the meta device, its weight
    store (weights are read per module on demand). The tokenizer and image processor are loaded
    now, or on first use with `lazy_processors` (the onboard process)."""

    model_type = read_model_type(model_dir)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("--device cuda requested but no CUDA device is available")
    check_weight_files(model_dir)  # a truncated or damaged file is a ModelError, not a library's traceback
    config = AutoConfig.from_pretrained(model_dir)
    torch_dtype = resolve_dtype(config, dtype)
    cls = getattr(transformers, _MODEL_CLASSES[model_type])
    with torch.device("meta"):
        model = cls._from_config(config, dtype=torch_dtype, attn_implementation=attn_implementation)
    model.eval()
    tied = {}
    if getattr(config, "tie_word_embeddings", False) or getattr(config.text_config, "tie_word_embeddings", False):
        tied = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    weights = WeightStore(model, model_dir, torch_dtype, device, tied=tied, read_hook=read_hook)
    missing = weights.missing_keys()
    if missing:
        raise ModelError(f"{model_dir} is missing {len(missing)} weights, e.g. {missing[0]}")
    processors = Processors(model_dir)
    if not lazy_processors:
        processors.load_all()
    eos: tuple[int, ...] = ()
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
        value = gen.eos_token_id
        eos = tuple(value) if isinstance(value, (list, tuple)) else ((value,) if value is not None else ())
    except OSError:
        pass
    adapter = ADAPTERS[model_type](model, config)
    return LoadedModel(
        model_dir=os.path.abspath(model_dir),
        model_type=model_type,
        config=config,
        model=model,
        adapter=adapter,
        weights=weights,
        processors=processors,
        dtype=torch_dtype,
        device=device,
        attn_implementation=attn_implementation,
        content_hash=content_hash(model_dir),
        eos_token_ids=eos,
    )
