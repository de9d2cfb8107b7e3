"""One directory per request holding its MANIFEST and checkpoint records.

Layout (docs/record-format.md §3):

    MANIFEST            what makes the bits reproducible; salt of the request
    vision.A, vision.B  alternating complete vision states (never overwrite the last good one)
    vision.out          merged visual tokens + DeepStack features, kept until prefill completes
    prefill/g<G>.c<C>.blk   one record per prefill block (KV of the group's layers + boundary hidden)
    prefill/l<L>.c<C>.hid   per-layer input hidden states (HCache-style policies)
    decode.log          append-only decode records
    RESULT              the finished answer; its presence makes everything else garbage
    recoveries.log      append-only: one RECOVERY record per restart (kept with RESULT)

Every record but the MANIFEST carries `written`: the bytes of checkpoint records the request
had written (over all its boots) before it, so the request's lifetime count survives a cut with
the records themselves and costs no write of its own (docs/record-format.md §3, "written").

The store validates what it reads and never trusts a record that fails its checks: `scan()`
checks headers and commit footers cheaply, full CRCs are checked when the data is read, and a
record that fails then is quarantined so the planner can re-plan without it.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from common import log as owlog
from common.durable import DurableFS
from common.record import Kind, Record, RecordError, decode, encode, read_envelope, read_partial
from flight.events import EngineEvent, Events

BLOCK_SUFFIX = ".blk"
HIDDEN_SUFFIX = ".hid"


# A background record gives way to ordered ones between slices of this size: at most one slice
# (a fraction of a millisecond on NVMe) ever delays a prefill block's record.
SLICE_BYTES = 128 << 10


def _sliced(chunks, between_slices):
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        for offset in range(0, len(view), SLICE_BYTES):
            between_slices()
            yield view[offset : offset + SLICE_BYTES]


def block_name(group: int, chunk: int) -> str:
    return f"g{group}.c{chunk}{BLOCK_SUFFIX}"


def hidden_name(layer: int, chunk: int) -> str:
    return f"l{layer}.c{chunk}{HIDDEN_SUFFIX}"


def prefill_block_parts(
    group: int, chunk: int, layers: tuple[int, int], tokens: tuple[int, int], kv: dict, hidden
) -> tuple[dict, dict]:
    """(meta, tensors) of a prefill block record: the layout `put_prefill_block` writes and
    `record_sizes` sizes (tensors may be common.record.TensorSpec)."""
    tensors = {}
    for layer, (k, v) in kv.items():
        tensors[f"k.{layer}"] = k
        tensors[f"v.{layer}"] = v
    if hidden is not None:
        tensors["hidden"] = hidden  # last, so a KV-only read stops before it
    return {"group": group, "chunk": chunk, "layers": list(layers), "tokens": list(tokens)}, tensors


def decode_record_tensors(kv: dict, tokens) -> dict:
    """Tensors of a decode record (KV slices of every layer, then the new token ids)."""
    tensors = {}
    for layer, (k, v) in kv.items():
        for kind, t in (("k", k), ("v", v)):
            if isinstance(t, dict):  # quantised: values + per-channel scales
                tensors[f"{kind}.{layer}"] = t["q"]
                tensors[f"{kind}.{layer}.scale"] = t["scale"]
            else:
                tensors[f"{kind}.{layer}"] = t
    tensors["tokens"] = tokens
    return tensors


@dataclass
class BlockInfo:
    group: int
    chunk: int
    layers: tuple[int, int]
    tokens: tuple[int, int]
    kv_bytes: int
    hidden_bytes: int
    path: str

    @property
    def has_hidden(self) -> bool:
        return self.hidden_bytes > 0


@dataclass
class LayerHiddenInfo:
    layer: int
    chunk: int
    nbytes: int
    path: str


@dataclass
class Frontier:
    """What the durable records say about a request's progress."""

    vision_block: int = 0  # vision blocks covered by the best vision state
    vision_state_path: str | None = None
    vision_done: bool = False  # vision.out valid
    blocks: dict[tuple[int, int], BlockInfo] = field(default_factory=dict)
    layer_hidden: dict[tuple[int, int], LayerHiddenInfo] = field(default_factory=dict)
    decode_records: list[Record] = field(default_factory=list)
    decode_log_end: int = 0  # byte offset just after the last good decode record
    result: Record | None = None
    # Lifetime bytes of checkpoint records up to the newest one found (the largest
    # `written` + record length): where a resumed request's count goes on from.
    written: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)

    @property
    def decode_steps(self) -> int:
        return int(self.decode_records[-1].meta["step_end"]) if self.decode_records else 0

    def phase(self) -> str:
        if self.result is not None:
            return "done"
        if self.decode_records:
            return "decode"
        if self.blocks or self.layer_hidden or self.vision_done:
            return "prefill"
        if self.vision_block:
            return "vision"
        return "start"


@dataclass
class OpenOutcome:
    salt: int
    status: str  # "fresh" | "resume" | "mismatch" | "unreadable_manifest"
    differences: dict  # key -> (stored, current) when status == "mismatch"


class CheckpointStore:
    def __init__(self, root: str, fs: DurableFS | None = None, events: Events | None = None):
        self.root = os.path.abspath(root)
        self.fs = fs or DurableFS()
        self.prefill_dir = os.path.join(self.root, "prefill")
        self.salt = 0
        self.bytes_written = 0  # this process lifetime's
        # Bytes of checkpoint records over the request's whole life, as far as handed out to
        # records being encoded (each record's `written` is this before its own bytes).
        self.lifetime_written = 0
        self._count_lock = threading.Lock()  # the background writer counts too
        self.events: Events = events or (lambda event, **kw: owlog.get().info(event, **kw))
        self._next_vision_slot = "A"

    # ---- paths ------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        return os.path.join(self.root, name)

    @property
    def decode_log(self) -> str:
        return self.path("decode.log")

    @property
    def recovery_log(self) -> str:
        return self.path("recoveries.log")

    # ---- opening ----------------------------------------------------------------------------
    def stored_manifest(self) -> dict | None:
        """The MANIFEST already in the directory, or None (absent or unreadable); reads only."""
        try:
            if not self.fs.exists(self.path("MANIFEST")):
                return None
            stored, _ = decode(self.fs.read(self.path("MANIFEST")), expect_kind=Kind.MANIFEST)
            manifest = stored.meta["manifest"]
        except (RecordError, KeyError, TypeError, OSError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def open(self, manifest: dict) -> OpenOutcome:
        """Adopt the directory for this request: resume if its MANIFEST matches, else start anew."""
        self.fs.makedirs(self.root)
        self.fs.makedirs(self.prefill_dir)
        for directory in (self.root, self.prefill_dir):
            for name in self.fs.listdir(directory):
                if name.endswith(".tmp"):
                    self.fs.remove(os.path.join(directory, name), sync=False)
        status = "fresh"
        differences: dict[str, Any] = {}
        if self.fs.exists(self.path("MANIFEST")):
            try:
                stored, _ = decode(self.fs.read(self.path("MANIFEST")), expect_kind=Kind.MANIFEST)
                old = stored.meta["manifest"]
                differences = {k: (old.get(k), v) for k, v in manifest.items() if old.get(k) != v}
                differences.update({k: (v, None) for k, v in old.items() if k not in manifest and k != "salt"})
                if not differences:
                    self.salt = int(old["salt"])
                    self.lifetime_written = self.fs.size(self.path("MANIFEST"))  # the rest: scan()
                    return OpenOutcome(self.salt, "resume", {})
                status = "mismatch"
            except (RecordError, KeyError, TypeError) as exc:
                status, differences = "unreadable_manifest", {"error": str(exc)}
        self.wipe()
        self.salt = secrets.randbits(63) or 1
        enc = encode(Kind.MANIFEST, {"manifest": {**manifest, "salt": self.salt}})
        self.lifetime_written = enc.nbytes
        self._count(self.fs.write_atomic(self.path("MANIFEST"), enc.chunks))
        return OpenOutcome(self.salt, status, differences)

    def wipe(self) -> None:
        """Remove every record of the directory (MANIFEST last, so a cut mid-wipe stays safe)."""
        for name in self.fs.listdir(self.prefill_dir):
            self.fs.remove(os.path.join(self.prefill_dir, name), sync=False)
        for name in self.fs.listdir(self.root):
            if name not in ("MANIFEST", "prefill"):
                self.fs.remove(self.path(name), sync=False)
        self.fs.remove(self.path("MANIFEST"), sync=False)
        self.fs.fsync_dir(self.prefill_dir) if self.fs.exists(self.prefill_dir) else None
        self.fs.fsync_dir(self.root)

    # ---- writing ----------------------------------------------------------------------------
    def _encode(self, kind: Kind, meta: dict, tensors: dict):
        """Encode a record with its `written` (the lifetime count before it) and count it in.
        Under the lock, so two writer threads never hand out one count twice: whichever record
        is newest on disk then carries every byte started before it."""
        with self._count_lock:
            enc = encode(kind, {**meta, "written": self.lifetime_written}, tensors, salt=self.salt)
            self.lifetime_written += enc.nbytes
        return enc

    def _write(self, path: str, kind: Kind, meta: dict, tensors: dict, between_slices=None) -> int:
        enc = self._encode(kind, meta, tensors)
        chunks = enc.chunks if between_slices is None else _sliced(enc.chunks, between_slices)
        n = self.fs.write_atomic(path, chunks)
        self._count(n)
        return n

    def _count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_written += n

    def put_vision_state(self, block: int, hidden: torch.Tensor, side: dict[str, torch.Tensor]) -> int:
        slot = self._next_vision_slot
        n = self._write(self.path(f"vision.{slot}"), Kind.VISION_STATE, {"block": block}, {"hidden": hidden, **side})
        self._next_vision_slot = "B" if slot == "A" else "A"
        return n

    def put_vision_out(self, embeds: torch.Tensor, side: dict[str, torch.Tensor], between_slices=None) -> int:
        """`between_slices`: called before each slice of the payload (see the writer's background
        records)."""
        return self._write(self.path("vision.out"), Kind.VISION_OUT, {}, {"embeds": embeds, **side}, between_slices)

    def put_prefill_block(
        self,
        group: int,
        chunk: int,
        layers: tuple[int, int],
        tokens: tuple[int, int],
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        hidden: torch.Tensor | None,
    ) -> int:
        meta, tensors = prefill_block_parts(group, chunk, layers, tokens, kv, hidden)
        return self._write(os.path.join(self.prefill_dir, block_name(group, chunk)), Kind.PREFILL_BLOCK, meta, tensors)

    def put_layer_hidden(self, layer: int, chunk: int, tokens: tuple[int, int], hidden: torch.Tensor) -> int:
        meta = {"layer": layer, "chunk": chunk, "tokens": list(tokens)}
        return self._write(
            os.path.join(self.prefill_dir, hidden_name(layer, chunk)), Kind.HIDDEN_LAYER, meta, {"hidden": hidden}
        )

    def prepare_decode_log(self, end: int) -> None:
        """Cut a torn or stale tail off the decode log before appending to it."""
        if self.fs.exists(self.decode_log) and self.fs.size(self.decode_log) != end:
            self.fs.truncate(self.decode_log, end)

    def append_decode(self, meta: dict, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], tokens: torch.Tensor) -> int:
        enc = self._encode(Kind.DECODE_STEPS, meta, decode_record_tensors(kv, tokens))
        n = self.fs.append(self.decode_log, enc.chunks)
        self._count(n)
        return n

    def recoveries(self) -> tuple[list[dict], int]:
        """The restarts recorded so far (each RECOVERY record's metadata, in order) and the byte
        offset just after the last good one: a torn or stale tail is not one of them."""
        if not self.fs.exists(self.recovery_log):
            return [], 0
        buf = self.fs.read(self.recovery_log)
        entries, pos = [], 0
        while pos < len(buf):
            try:
                rec, length = decode(buf, pos, expect_kind=Kind.RECOVERY)
            except RecordError as exc:
                self.events(EngineEvent.RECORD_REJECTED, file="recoveries.log", offset=pos, reason=exc.reason)
                break
            if rec.salt != self.salt:
                self.events(EngineEvent.RECORD_REJECTED, file="recoveries.log", offset=pos, reason="stale_salt")
                break
            entries.append({k: v for k, v in rec.meta.items() if k not in ("tensors", "salt")})
            pos += length
        return entries, pos

    def append_recovery(self, entry: dict) -> list[dict]:
        """Make one restart's entry durable (after cutting a torn tail off the log): every
        restart recorded once, whatever cut comes next. The entries with it, in order."""
        entries, end = self.recoveries()
        if self.fs.exists(self.recovery_log) and self.fs.size(self.recovery_log) != end:
            self.fs.truncate(self.recovery_log, end)
        self.fs.append(self.recovery_log, encode(Kind.RECOVERY, entry, salt=self.salt).chunks)
        return [*entries, entry]

    def put_result(self, token_ids: list[int], logits: torch.Tensor, text: str, finish_reason: str) -> int:
        return self._write(
            self.path("RESULT"),
            Kind.RESULT,
            {"text": text, "finish_reason": finish_reason},
            {"token_ids": torch.tensor(token_ids, dtype=torch.int64), "logits": logits},
        )

    def gc(self) -> None:
        """After RESULT is durable: drop everything the result made unnecessary."""
        for name in self.fs.listdir(self.prefill_dir):
            self.fs.remove(os.path.join(self.prefill_dir, name), sync=False)
        for name in ("vision.A", "vision.B", "vision.out", "decode.log"):
            self.fs.remove(self.path(name), sync=False)
        self.fs.fsync_dir(self.prefill_dir)
        self.fs.fsync_dir(self.root)

    def remove_vision(self) -> None:
        for name in ("vision.A", "vision.B"):
            self.fs.remove(self.path(name), sync=False)
        self.fs.fsync_dir(self.root)

    def quarantine(self, path: str, reason: str) -> None:
        """A record failed verification while being read: move it aside so it is never used."""
        self.events(EngineEvent.RECORD_REJECTED, file=os.path.relpath(path, self.root), reason=reason)
        try:
            os.replace(path, path + ".bad")
        except OSError:
            self.fs.remove(path)

    # ---- reading ----------------------------------------------------------------------------
    def _envelope_ok(self, path: str, kind: Kind):
        """Cheap check of a whole-file record: header CRC, sizes, commit footer, salt; no payload
        read. Returns the verified header or None (and logs why)."""
        rel = os.path.relpath(path, self.root)
        try:
            with self.fs.open_read(path) as f:
                header = read_envelope(f, os.fstat(f.fileno()).st_size)
        except (RecordError, OSError) as exc:
            reason = exc.reason if isinstance(exc, RecordError) else type(exc).__name__
            self.events(EngineEvent.RECORD_REJECTED, file=rel, reason=reason)
            return None
        if header.kind != kind:
            self.events(EngineEvent.RECORD_REJECTED, file=rel, reason="bad_meta")
            return None
        if int(header.meta.get("salt", 0)) != self.salt:
            self.events(EngineEvent.RECORD_REJECTED, file=rel, reason="stale_salt")
            return None
        return header

    def read_full(self, path: str, kind: Kind) -> Record:
        """Read and fully verify a whole-file record (raises RecordError)."""
        try:
            buf = self.fs.read(path)
        except OSError as exc:
            raise RecordError("truncated", str(exc)) from None
        rec, _ = decode(buf, expect_kind=kind)
        if rec.salt != self.salt:
            raise RecordError("stale_salt")
        return rec

    def scan(self) -> Frontier:
        """The frontier the durable records make; also where the lifetime count goes on from."""
        fr = self._scan()
        with self._count_lock:
            self.lifetime_written = max(self.lifetime_written, fr.written)
        return fr

    def _scan(self) -> Frontier:
        fr = Frontier()

        def saw(meta: dict, length: int) -> None:
            written = meta.get("written")
            if isinstance(written, int) and not isinstance(written, bool):
                fr.written = max(fr.written, written + length)

        if self.fs.exists(self.path("RESULT")):
            try:
                fr.result = self.read_full(self.path("RESULT"), Kind.RESULT)
                saw(fr.result.meta, self.fs.size(self.path("RESULT")))
                return fr
            except RecordError as exc:
                self.quarantine(self.path("RESULT"), exc.reason)
        best = None
        for slot in ("A", "B"):
            p = self.path(f"vision.{slot}")
            if self.fs.exists(p) and (hdr := self._envelope_ok(p, Kind.VISION_STATE)) is not None:
                saw(hdr.meta, hdr.record_len)
                if best is None or hdr.meta["block"] > best[0]:
                    best = (int(hdr.meta["block"]), p, slot)
        if best:
            fr.vision_block, fr.vision_state_path, slot = best
            self._next_vision_slot = "B" if slot == "A" else "A"
        if self.fs.exists(self.path("vision.out")) and (
            hdr := self._envelope_ok(self.path("vision.out"), Kind.VISION_OUT)
        ):
            saw(hdr.meta, hdr.record_len)
            fr.vision_done = True
        for name in self.fs.listdir(self.prefill_dir):
            p = os.path.join(self.prefill_dir, name)
            if name.endswith(BLOCK_SUFFIX) and (hdr := self._envelope_ok(p, Kind.PREFILL_BLOCK)):
                m, table = hdr.meta, hdr.meta["tensors"]
                saw(m, hdr.record_len)
                fr.blocks[(int(m["group"]), int(m["chunk"]))] = BlockInfo(
                    int(m["group"]),
                    int(m["chunk"]),
                    tuple(m["layers"]),
                    tuple(m["tokens"]),
                    sum(e["nbytes"] for e in table if e["name"] != "hidden"),
                    sum(e["nbytes"] for e in table if e["name"] == "hidden"),
                    p,
                )
            elif name.endswith(HIDDEN_SUFFIX) and (hdr := self._envelope_ok(p, Kind.HIDDEN_LAYER)):
                m = hdr.meta
                saw(m, hdr.record_len)
                fr.layer_hidden[(int(m["layer"]), int(m["chunk"]))] = LayerHiddenInfo(
                    int(m["layer"]), int(m["chunk"]), hdr.record_len, p
                )
        self._scan_decode_log(fr)
        return fr

    def _scan_decode_log(self, fr: Frontier) -> None:
        if not self.fs.exists(self.decode_log):
            return
        buf = self.fs.read(self.decode_log)
        pos, expect_step = 0, 0
        while pos < len(buf):
            try:
                rec, length = decode(buf, pos, expect_kind=Kind.DECODE_STEPS)
            except RecordError as exc:
                self.events(EngineEvent.RECORD_REJECTED, file="decode.log", offset=pos, reason=exc.reason)
                break
            if rec.salt != self.salt or int(rec.meta["step_start"]) != expect_step:
                self.events(
                    EngineEvent.RECORD_REJECTED,
                    file="decode.log",
                    offset=pos,
                    reason="stale_salt" if rec.salt != self.salt else "out_of_sequence",
                )
                break
            fr.decode_records.append(rec)
            written = rec.meta.get("written")
            if isinstance(written, int) and not isinstance(written, bool):
                fr.written = max(fr.written, written + length)
            expect_step = int(rec.meta["step_end"])
            pos += length
        fr.decode_log_end = pos

    def read_vision_state(self, fr: Frontier) -> Record | None:
        """The newest valid vision state (the one the scan found), falling back to the other
        buffer only if it fails its checks: one state read in the normal case, not two."""
        candidates = []
        if fr.vision_state_path:
            candidates.append(fr.vision_state_path)
        for slot in ("A", "B"):
            p = self.path(f"vision.{slot}")
            if p not in candidates and self.fs.exists(p):
                candidates.append(p)
        records = []
        for p in candidates:
            try:
                records.append(self.read_full(p, Kind.VISION_STATE))
            except RecordError as exc:
                self.quarantine(p, exc.reason)
                continue
            if fr.vision_state_path:
                break  # newest first: the first that checks out is the one
        return max(records, key=lambda r: r.meta["block"]) if records else None

    def read_vision_out(self) -> Record | None:
        p = self.path("vision.out")
        if not self.fs.exists(p):
            return None
        try:
            return self.read_full(p, Kind.VISION_OUT)
        except RecordError as exc:
            self.quarantine(p, exc.reason)
            return None

    def read_block(self, info: BlockInfo, parts: set[str]) -> dict[str, torch.Tensor]:
        """Read the KV ('kv') and/or boundary hidden ('hidden') of a block, verifying what is read."""
        names = set()
        if "kv" in parts:
            for layer in range(*info.layers):
                names |= {f"k.{layer}", f"v.{layer}"}
        if "hidden" in parts:
            names.add("hidden")
        with self.fs.open_read(info.path) as f:
            size = os.fstat(f.fileno()).st_size
            rec = read_partial(f, names, size)
        self.fs.charge_read(sum(t.numel() * t.element_size() for t in rec.tensors.values()))
        if rec.salt != self.salt:
            raise RecordError("stale_salt")
        missing = names - set(rec.tensors)
        if missing:
            raise RecordError("bad_meta", f"block record lacks {sorted(missing)}")
        return rec.tensors

    def read_layer_hidden(self, info: LayerHiddenInfo) -> torch.Tensor:
        return self.read_full(info.path, Kind.HIDDEN_LAYER).tensors["hidden"]
