"""docs/record-format.md against the bytes the engine writes.

Real checkpoint directories are made by the engine with every policy (and int8 decode records),
each request cut in vision, in prefill and in decode and resumed after each cut, and copied at
every cut. The independent reader (record_reader.py, written from the document, no project
import) must parse and verify every record, the kinds, keys, tensors and shapes must be the ones
§3 and §4 name, and bits flipped in real records must be rejected with the reason §2 gives --
the same reason `common.record` gives.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from record_reader import DOC, ITEMSIZE, KINDS, ParsedRecord, Rejected, padding_is_zero, read_log, read_record
from testkit import CutAfter, engine, inputs_for

from common import record as project_record
from common.durable import DurableFS
from flight.checkpoint.policies import Geometry
from flight.engine import SimulatedCut
from flight.model.loader import load_model

GEOMETRY = Geometry(chunk=16, group=2, decode_every=2, vision_every=1)
MAX_NEW = 6
#: (label, policy, engine options)
RUNS = [
    ("orbitweaver", "orbitweaver", {}),
    ("sonic-layer", "sonic-layer", {}),
    ("sonic-chunk", "sonic-chunk", {}),
    ("hcache", "hcache", {}),
    ("hcache+", "hcache+", {}),
    ("int8", "orbitweaver", {"decode_kv_compression": "int8"}),
]
#: the cut of each process lifetime: (phase, event, occurrence); the last lifetime completes
# (events come before the unit's record is handed to the writer: a cut at the n-th keeps n - 1)
CUTS = [("vision", "vision_block_done", 2), ("prefill", "prefill_block_done", 3), ("decode", "decode_step_done", 5)]
WHOLE_FILE_KINDS = {
    "MANIFEST": "MANIFEST",
    "vision.A": "VISION_STATE",
    "vision.B": "VISION_STATE",
    "vision.out": "VISION_OUT",
    "RESULT": "RESULT",
}


class TempWatchingFS(DurableFS):
    """The real file layer; while a whole-file record is being written it lists the directory,
    to see the temporary file's real name on disk (§5)."""

    def __init__(self):
        self.temp_names: list[tuple[str, str, int]] = []  # (directory, name, writer's thread id)

    def write_atomic(self, path, chunks):
        directory, final = os.path.split(path)

        def watched():
            for i, chunk in enumerate(chunks):
                if i == 0:
                    temps = [n for n in os.listdir(directory) if n.endswith(".tmp") and final in n]
                    self.temp_names.extend((final, n, threading.get_ident()) for n in temps)
                yield chunk

        return super().write_atomic(path, watched())


def _snapshot(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _make_checkpoints(model_dir: str, root: Path) -> dict:
    model = load_model(model_dir, device="cpu")
    inputs = inputs_for(model)
    fs = TempWatchingFS()
    snapshots: dict[str, list[tuple[str, str]]] = {}
    for label, policy, options in RUNS:
        ckpt = root / label
        for phase, event, n in CUTS:
            cut = CutAfter(n, names=(event,))
            with pytest.raises(SimulatedCut):
                engine(model, GEOMETRY, policy, events=cut.event, fs=fs, **options).run(inputs, str(ckpt), MAX_NEW)
            snapshots.setdefault(label, []).append((phase, str(_snapshot(ckpt, root / "snap" / label / phase))))
        engine(model, GEOMETRY, policy, fs=fs, **options).run(inputs, str(ckpt), MAX_NEW)
        snapshots[label].append(("completed", str(_snapshot(ckpt, root / "snap" / label / "completed"))))
    return {"snapshots": snapshots, "temps": fs.temp_names, "pid": os.getpid(), "dims": _text_dims(model.config)}


@pytest.fixture(scope="session")
def written(model_dirs, tmp_path_factory):
    """{"snapshots": {label: [(phase of the cut or "completed", snapshot directory)]}, "temps":
    temporary names seen, "pid": of the writer, "dims": of the text model}.

    Made once per run: under pytest-xdist the workers share their base directory's parent, and
    the first worker to get here makes the checkpoints while the other waits on the lock."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "format-records"
        root.mkdir(exist_ok=True)
    else:
        root = tmp_path_factory.mktemp("format-records")
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = root / "index.json"
        if not index.exists():
            index.write_text(json.dumps(_make_checkpoints(model_dirs["qwen3-vl"], root)))
        made = json.loads(index.read_text())
    made["snapshots"] = {
        label: [(phase, Path(path)) for phase, path in found] for label, found in made["snapshots"].items()
    }
    return made


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _kind_of(path: Path, directory: Path) -> str:
    rel = path.relative_to(directory).as_posix()
    if rel in WHOLE_FILE_KINDS:
        return WHOLE_FILE_KINDS[rel]
    if re.fullmatch(r"prefill/g\d+\.c\d+\.blk", rel):
        return "PREFILL_BLOCK"
    if re.fullmatch(r"prefill/l\d+\.c\d+\.hid", rel):
        return "HIDDEN_LAYER"
    if rel == "decode.log":
        return "DECODE_STEPS"
    if rel == "recoveries.log":
        return "RECOVERY"
    raise AssertionError(f"{rel}: a file §3 does not name")


def _manifest_keys_of_doc() -> list[str]:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## 4. The MANIFEST") : text.index("## 5.")]
    first_cells = re.findall(r"^\| ((?:`\w+`(?:, )?)+) \|", section, re.M)
    return [key for cell in first_cells for key in re.findall(r"`(\w+)`", cell)]


def _text_dims(config):
    text = getattr(config, "text_config", config)
    heads = text.num_attention_heads
    return {
        "layers": text.num_hidden_layers,
        "kv_heads": getattr(text, "num_key_value_heads", heads),
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "hidden": text.hidden_size,
        "vocab": text.vocab_size,
    }


def _check_kv(record: ParsedRecord, layers, tokens: int, dims, int8: bool, where: str) -> None:
    for layer in layers:
        for part in ("k", "v"):
            tensor = record.tensors[f"{part}.{layer}"]
            assert tensor.shape == (1, dims["kv_heads"], tokens, dims["head_dim"]), where
            if int8:
                assert tensor.dtype == "int8", where
                scale = record.tensors[f"{part}.{layer}.scale"]
                assert scale.dtype == "float32" and scale.shape == (1, dims["kv_heads"], tokens, 1), where
            else:
                assert f"{part}.{layer}.scale" not in record.tensors, where


def test_every_real_record_reads_as_documented(written):
    dims = written["dims"]
    documented_manifest = _manifest_keys_of_doc()
    checked = {kind: 0 for kind in KINDS.values()}
    for label, snapshots in written["snapshots"].items():
        policy = dict((lbl, pol) for lbl, pol, _ in RUNS)[label]
        for phase, directory in snapshots:
            files = _files(directory)
            names = {p.relative_to(directory).as_posix() for p in files}
            assert "MANIFEST" in names, (label, phase)
            assert ("RESULT" in names) == (phase == "completed"), (label, phase, names)
            manifest = read_record((directory / "MANIFEST").read_bytes())
            assert manifest.kind_name == "MANIFEST" and manifest.meta["salt"] == 0 and not manifest.tensors
            pinned = manifest.meta["manifest"]
            assert sorted(pinned) == sorted(documented_manifest), (
                f"§4 lists {documented_manifest}, bytes {sorted(pinned)}"
            )
            assert pinned["policy"] == policy
            int8 = pinned["decode_kv_compression"] == "int8"
            assert pinned["decode_kv_compression"] == ("int8" if label == "int8" else "none")
            salt = pinned["salt"]
            for path in files:
                where = f"{label}/{phase}/{path.relative_to(directory)}"
                kind = _kind_of(path, directory)
                buf = path.read_bytes()
                if kind in ("DECODE_STEPS", "RECOVERY"):
                    records, rejected = read_log(buf)
                    assert rejected is None and records, where
                else:
                    records = [read_record(buf)]
                    assert records[0].length == len(buf), f"{where}: one record per file"
                expected_step = 0
                for record in records:
                    assert record.kind_name == kind, where
                    assert padding_is_zero(buf, record), where
                    # N is not padded: the footer follows the last tensor's last byte
                    end = max((t.offset + len(t.data) for t in record.tensors.values()), default=0)
                    assert record.payload_len == end, where
                    if kind != "MANIFEST":
                        assert record.meta["salt"] == salt, where
                    if kind not in ("MANIFEST", "RECOVERY"):  # §1 "written": the lifetime count before it
                        assert isinstance(record.meta["written"], int) and record.meta["written"] > 0, where
                    checked[kind] += 1
                    meta, tensors = record.meta, record.tensors
                    if kind == "VISION_STATE":
                        assert isinstance(meta["block"], int) and "hidden" in tensors
                        assert set(tensors) <= {"hidden"} | {n for n in tensors if re.fullmatch(r"deepstack\.\d+", n)}
                    elif kind == "VISION_OUT":
                        embeds = tensors["embeds"]
                        assert len(embeds.shape) == 2 and embeds.shape[1] == dims["hidden"], where
                        for name in set(tensors) - {"embeds"}:
                            assert re.fullmatch(r"deepstack\.\d+", name) and tensors[name].shape == embeds.shape
                    elif kind == "PREFILL_BLOCK":
                        first, end_layer = meta["layers"]
                        start, stop = meta["tokens"]
                        assert path.name == f"g{meta['group']}.c{meta['chunk']}.blk", where
                        kv_names = [n for n in tensors if n != "hidden"]
                        if policy == "hcache":
                            assert not kv_names, f"{where}: hcache keeps hidden states only"
                        elif policy == "hcache+" and meta["group"] % 2:
                            assert not kv_names, f"{where}: hcache+ re-projects odd layers"
                        elif kv_names:
                            assert sorted(kv_names) == sorted(
                                f"{p}.{layer}" for layer in range(first, end_layer) for p in "kv"
                            )
                            _check_kv(record, range(first, end_layer), stop - start, dims, False, where)
                        if "hidden" in tensors:
                            assert list(tensors)[-1] == "hidden", f"{where}: hidden is placed last"
                            assert tensors["hidden"].shape == (1, stop - start, dims["hidden"]), where
                    elif kind == "DECODE_STEPS":
                        assert meta["step_start"] == expected_step, where
                        steps = meta["step_end"] - meta["step_start"]
                        assert steps > 0 and meta["pos_end"] - meta["pos_start"] == steps, where
                        assert isinstance(meta["first_token"], int), f"{where}: first_token in every record"
                        expected_step = meta["step_end"]
                        layers = range(dims["layers"])
                        _check_kv(record, layers, steps, dims, int8, where)
                        token_ids = tensors["tokens"]
                        assert token_ids.dtype == "int64" and token_ids.shape == (steps,), where
                        assert list(tensors)[-1] == "tokens", where
                    elif kind == "RECOVERY":
                        assert not tensors, where
                        assert meta["phase"] in ("start", "vision", "prefill", "decode", "done"), where
                        assert isinstance(meta["restart"], int) and meta["restart"] >= 1, where
                        assert meta["restore_s"] >= 0 and isinstance(meta["planner"], str), where
                        assert isinstance(meta["written"], int), where
                    elif kind == "RESULT":
                        ids = tensors["token_ids"]
                        assert ids.dtype == "int64" and ids.shape == (MAX_NEW,), where
                        assert tensors["logits"].shape == (1, dims["vocab"]), where
                        assert isinstance(meta["text"], str) and isinstance(meta["finish_reason"], str)
    # every request kind the engine writes was seen (HIDDEN_LAYER: no shipped policy writes it)
    for kind in ("MANIFEST", "VISION_STATE", "VISION_OUT", "PREFILL_BLOCK", "DECODE_STEPS", "RECOVERY", "RESULT"):
        assert checked[kind], f"no real {kind} record was checked"


def test_hcache_writes_kind_4_hidden_state_records(written):
    """§3: hcache's prefill records are PREFILL_BLOCKs holding `hidden` only; the last group's
    are markers with no tensor except on the last chunk."""
    snapshots = dict(written["snapshots"]["hcache"])
    directory = snapshots["decode"]
    blocks = [read_record(p.read_bytes()) for p in sorted((directory / "prefill").glob("*.blk"))]
    assert blocks and not list((directory / "prefill").glob("*.hid"))
    last_group = max(b.meta["group"] for b in blocks)
    last_chunk = max(b.meta["chunk"] for b in blocks)
    for block in blocks:
        marker = block.meta["group"] == last_group and block.meta["chunk"] != last_chunk
        assert set(block.tensors) == (set() if marker else {"hidden"}), block.meta


def test_hcache_plus_writes_empty_markers_for_reprojected_layers(written):
    """§3: hcache+ keeps KV + hidden of even layers and writes empty markers for odd ones."""
    directory = dict(written["snapshots"]["hcache+"])["decode"]
    blocks = [read_record(p.read_bytes()) for p in sorted((directory / "prefill").glob("*.blk"))]
    last_group = max(b.meta["group"] for b in blocks)
    last_chunk = max(b.meta["chunk"] for b in blocks)
    for block in blocks:
        group = block.meta["group"]
        if group % 2 == 0:
            assert set(block.tensors) == {f"k.{group}", f"v.{group}", "hidden"}, block.meta
        elif group == last_group and block.meta["chunk"] == last_chunk:
            assert set(block.tensors) == {"hidden"}, block.meta
        else:
            assert not block.tensors and block.payload_len == 0, block.meta


def test_decode_log_records_follow_each_other_unaligned(written):
    """§1: records in an appended file start where the previous one ended, not at a multiple of 64."""
    directory = dict(written["snapshots"]["orbitweaver"])["decode"]
    records, _ = read_log((directory / "decode.log").read_bytes())
    starts = [r.start for r in records]
    assert len(records) >= 2
    assert starts == [sum(r.length for r in records[:i]) for i in range(len(records))]
    assert any(s % 64 for s in starts[1:]), "every record happened to be aligned; pick other shapes"


def test_temporary_file_names_are_the_documented_ones(written):
    text = DOC.read_text(encoding="utf-8")
    documented = re.search(r"its name is `([^`]+)`", text).group(1)
    assert documented == ".<final>.<pid>.<thread>.<n>.tmp"
    temps = written["temps"]
    assert temps, "no temporary file was seen while records were written"
    for final, name, thread in temps:
        match = re.fullmatch(rf"\.{re.escape(final)}\.(\d+)\.(\d+)\.(\d+)\.tmp", name)
        assert match, name
        assert int(match.group(1)) == written["pid"] and int(match.group(2)) == thread, name


def _expected_reason(buf: bytes, start: int, position: int) -> str:
    """§2's table: the reason a record read whole is rejected with after one flipped bit at
    `position` (relative to the record), `buf[start:]` holding the damaged record and what follows."""
    meta_len = int.from_bytes(buf[start + 8 : start + 12], "little")
    payload_len = int.from_bytes(buf[start + 12 : start + 20], "little")
    if position < 4:
        return "bad_magic"
    if position < 6:
        return "bad_version"
    if 8 <= position < 12:
        if meta_len > 16 * 1024 * 1024:
            return "bad_length"
        if 24 + meta_len > len(buf) - start:
            return "truncated"
        return "header_crc"
    if position < 24 + meta_len:
        return "header_crc"
    footer = -(-(24 + meta_len) // 64) * 64 + payload_len
    if position < footer + 4:
        return "record_crc"
    if position < footer + 12:
        return "bad_length"
    return "no_commit"


def _flip_positions(record: ParsedRecord) -> list[int]:
    """Every byte of the fixed header and the footer, and bytes spread over the rest."""
    rest = range(24, record.length - 16)
    spread = list(rest[:: max(1, len(rest) // 24)])
    return list(range(24)) + spread + list(range(record.length - 16, record.length))


def test_flipped_bits_are_rejected_with_the_documented_reason(written):
    flips = 0
    seen: set[str] = set()
    for label, snapshots in written["snapshots"].items():
        for phase, directory in snapshots:
            for path in _files(directory):
                buf = path.read_bytes()
                if path.name in ("decode.log", "recoveries.log"):
                    records, _ = read_log(buf)
                    record = records[-1] if phase == "decode" else records[0]
                else:
                    record = read_record(buf)
                for position in _flip_positions(record):
                    for bit in (0, 3, 7):
                        damaged = bytearray(buf)
                        damaged[record.start + position] ^= 1 << bit
                        expected = _expected_reason(bytes(damaged), record.start, position)
                        try:
                            read_record(bytes(damaged), record.start)
                            got = "accepted"
                        except Rejected as exc:
                            got = exc.reason
                        with pytest.raises(project_record.RecordError) as caught:
                            project_record.decode(bytearray(damaged), record.start)
                        where = f"{label}/{phase}/{path.name} byte {position} bit {bit}"
                        assert got == expected == caught.value.reason, (
                            f"{where}: doc {expected}, reader {got}, code {caught.value.reason}"
                        )
                        seen.add(expected)
                        flips += 1
    assert seen == {"bad_magic", "bad_version", "bad_length", "truncated", "header_crc", "record_crc", "no_commit"}
    assert flips > 1000


def test_the_reasons_are_the_documented_ones():
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## 2. Acceptance rule") : text.index("## 3. Kinds")]
    documented = set(re.findall(r"\| `(\w+)`(?: / `(\w+)`)? \|$", section, re.M))
    names = {name for pair in documented for name in pair if name}
    assert names == set(project_record.REASONS)


def test_an_undefined_kind_is_rejected_by_name(tmp_path):
    """§2 step 8: a verified record of a kind §3 does not define is `bad_kind`, whole or partial."""
    assert 9 not in KINDS and 9 not in set(project_record.Kind)
    data = project_record.encode(9, {"x": 1}, {"t": torch.arange(3)}).to_bytes()  # type: ignore[arg-type]
    with pytest.raises(Rejected, match="bad_kind"):
        read_record(data)
    with pytest.raises(project_record.RecordError, match="bad_kind"):
        project_record.decode(bytearray(data))
    path = tmp_path / "r"
    path.write_bytes(data)
    with open(path, "rb") as f, pytest.raises(project_record.RecordError, match="bad_kind"):
        project_record.read_partial(f, {"t"}, len(data))


def test_the_documented_dtypes_are_the_ones_the_code_knows():
    assert ITEMSIZE == project_record.ITEMSIZE
    for name, size in ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size, name
