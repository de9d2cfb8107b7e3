"""What a model directory is, without loading it: importable without torch or transformers (the
onboard process checks its model directory before anything heavy is imported)."""

from __future__ import annotations

import hashlib
import json
import os
import struct

#: architectures the engine drives (flight/model/adapters.py has one adapter per entry)
MODEL_CLASSES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


class ModelError(ValueError):
    """The model directory cannot be used (missing, wrong architecture, incomplete). One line."""


def read_model_type(model_dir: str) -> str:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise ModelError(f"model directory not found: {model_dir}")
    if not os.path.isfile(path):
        raise ModelError(f"not a model directory (no config.json): {model_dir}")
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"unreadable config.json in {model_dir}: {exc}") from None
    if model_type not in MODEL_CLASSES:
        raise ModelError(
            f"{model_dir} holds a {model_type!r} model; supported architectures: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return model_type


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of a model directory (sharded with an index, or single)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in files]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    return sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))


#: The largest JSON header a safetensors file may have: the safetensors library's own bound
#: (MAX_HEADER_SIZE, 100 MB), which it checks too; here it bounds what is read before that.
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000


def check_weight_file(path: str) -> None:
    """A weight file that is a whole safetensors file, or ModelError naming what is wrong: too
    short, a header length beyond the file (a random or damaged file, a length field claiming
    gigabytes: nothing that size is allocated), a header that is not JSON, tensor data that runs
    past the end (a truncated copy) or does not reach it. The safetensors library checks the
    same when it opens the file, but without a message that names the file, and it cannot be
    imported without numpy or torch; this check needs neither, so the testbench runs it before
    it writes anything."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelError(f"weight file {path} is not a safetensors file: {size} bytes, shorter than its header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
                raise ModelError(
                    f"weight file {path} is not a safetensors file (or is damaged): its header length field says "
                    f"{header_len} bytes, the file has {size}"
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise ModelError(f"cannot read weight file {path}: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ModelError(f"weight file {path} is not a safetensors file (or is damaged): unreadable header") from None
    data = size - 8 - header_len
    end = max(ends, default=0)
    if end > data:
        raise ModelError(
            f"weight file {path} is truncated: its tensors need {end} bytes of data after the header, the file "
            f"has {data}"
        )
    if end < data:
        raise ModelError(f"weight file {path} is damaged: {data - end} bytes after its last tensor")


def check_weight_files(model_dir: str) -> list[str]:
    """The model directory's weight files (`weight_files`), each checked (`check_weight_file`);
    ModelError when there is none or one is not whole."""
    try:
        files = weight_files(model_dir)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"unreadable model.safetensors.index.json in {model_dir}: {exc}") from None
    if not files:
        raise ModelError(f"no safetensors weights in {model_dir}")
    for path in files:
        check_weight_file(path)
    return files


#: files that decide how a prompt and images become input ids and pixel values
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
)


def processors_hash(model_dir: str) -> str:
    """sha256 over the tokenizer and image-processor files: stored inputs built with other ones
    are rebuilt."""

    h = hashlib.sha256()
    for name in PROCESSOR_FILES:
        path = os.path.join(model_dir, name)
        if os.path.isfile(path):
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def page_in(paths: list[str]) -> int:
    """Ask the kernel to read these files into the page cache in the background (no thread of
    ours waits): a cold boot's weight reads then overlap the interpreter's imports. Returns the
    bytes asked for."""
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            total += size
        finally:
            os.close(fd)
    return total
