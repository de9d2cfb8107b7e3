"""Message types: one frozen dataclass per MessageType, with strict field validation.

Construction validates (from Python code or from the wire alike) and raises WireError with the
code for the class of bad input. `pack()` gives the msgpack body (a map keyed by field name);
`Message.unpack(body)` checks that the map has exactly the declared fields and builds the
message. Framing, CRC and the secondary header are `common.wire.packet`'s business.

Telemetry fields tagged with a TlmChannel are also reachable by channel id via `channels()`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import crc32c as _crc32c_lib

from common.wire import fields as f
from common.wire.errors import RequestRef, WireError
from common.wire.ids import (
    DEFAULT_CHUNK_DATA_BYTES,
    MAX_CHUNK_DATA_BYTES,
    MAX_EVENT_TEXT_BYTES,
    MAX_HISTORY_WINDOWS,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_CHUNKS,
    MAX_IMAGES_PER_TASK,
    MAX_ITEM_BYTES,
    MAX_LISTED_ITEMS,
    MAX_LISTED_TASKS,
    MAX_NEW_TOKENS,
    MAX_PRIORITY,
    MAX_PROFILE_PHASES,
    MAX_PROFILE_TEXT_BYTES,
    MAX_PROMPT_BYTES,
    MAX_REASON_BYTES,
    MAX_RECOVERIES,
    MAX_RESULT_TEXT_BYTES,
    MAX_TIMINGS,
    SEQ_MAX,
    EventId,
    FdirMode,
    MessageType,
    PowerCause,
    ResponseCode,
    Severity,
    StorageState,
    TaskPhase,
    TlmChannel,
)
from common.wire.rules import prompt_rule

U16 = 0xFFFF
U32 = 0xFFFF_FFFF
U64 = 0xFFFF_FFFF_FFFF_FFFF

_REGISTRY: dict[int, type[Message]] = {}


def wire(spec: f.Spec, *, default: Any = dataclasses.MISSING, channel: TlmChannel | None = None) -> Any:
    """Declare a message field: its wire spec, an optional default (the field may then be absent
    on the wire) and the telemetry channel it feeds. List fields are annotated `Sequence`: any
    sequence is accepted and the spec stores it as a tuple."""
    return dataclasses.field(default=default, metadata={"spec": spec, "channel": channel})


def message_class(message_type: int) -> type[Message] | None:
    """The class for a message type id, or None if the id is not defined."""
    return _REGISTRY.get(message_type)


def all_message_classes() -> list[type[Message]]:
    return [_REGISTRY[t] for t in sorted(_REGISTRY)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Message:
    TYPE: ClassVar[MessageType]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        message_type = cls.__dict__.get("TYPE")
        if message_type is not None:
            if message_type in _REGISTRY:
                raise TypeError(f"{message_type!r} declared twice: {_REGISTRY[message_type].__name__}, {cls.__name__}")
            _REGISTRY[message_type] = cls

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            checked = field.metadata["spec"].check(getattr(self, field.name), field.name)
            object.__setattr__(self, field.name, checked)
        self._validate()

    def _validate(self) -> None:
        """Rules that involve more than one field; subclasses raise WireError."""

    @classmethod
    def is_command(cls) -> bool:
        return cls.TYPE.is_command

    def pack(self) -> dict[str, Any]:
        return {
            field.name: field.metadata["spec"].to_wire(getattr(self, field.name)) for field in dataclasses.fields(self)
        }

    @classmethod
    def unpack(cls, body: Any) -> Self:
        if not isinstance(body, dict):
            raise WireError(ResponseCode.BODY_UNDECODABLE, f"body must be a map, got {type(body).__name__}")
        declared = {field.name: field for field in dataclasses.fields(cls)}
        for key in body:
            if key not in declared:
                raise WireError(
                    ResponseCode.UNEXPECTED_FIELD,
                    f"{cls.TYPE.name}: unexpected field {str(key)[:64]!r}",
                    field=str(key)[:64],
                )
        for name, field in declared.items():
            if name not in body and field.default is dataclasses.MISSING:
                raise WireError(ResponseCode.MISSING_FIELD, f"{cls.TYPE.name}: missing field {name!r}", field=name)
        return cls(**body)

    def channels(self) -> dict[TlmChannel, Any]:
        """Telemetry channel id -> value, for the fields that feed a channel."""
        return {
            field.metadata["channel"]: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata["channel"] is not None
        }


# --- telecommands (ground -> payload) ---------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ping(Message):
    """Health ping (F Prime style): answered with PONG carrying the same key."""

    TYPE = MessageType.PING
    key: int = wire(f.UInt(U32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Status(Message):
    """Ask for one HOUSEKEEPING report now."""

    TYPE = MessageType.STATUS


@dataclasses.dataclass(frozen=True, kw_only=True)
class UplinkTask(Message):
    """Queue an inference task. Its images must be uploaded (IMAGE_CHUNK) before it can start;
    higher `priority` runs first, ties in arrival order."""

    TYPE = MessageType.UPLINK_TASK
    task_id: str = wire(f.Name())
    prompt: str = wire(f.Text(MAX_PROMPT_BYTES, min_chars=1))
    images: Sequence[str] = wire(f.ListOf(f.Name(), MAX_IMAGES_PER_TASK, unique=True))
    max_new_tokens: int = wire(f.UInt(MAX_NEW_TOKENS, minimum=1))
    priority: int = wire(f.UInt(MAX_PRIORITY))

    def _validate(self) -> None:
        # Checked here, at uplink, so that it never fails later as something else; the same rule
        # as the ground's, `ow infer`'s and the input building's (common/wire/rules.py).
        broken = prompt_rule(self.prompt)
        if broken is not None:
            raise WireError(broken.code, broken.reason, field=broken.field)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CancelTask(Message):
    TYPE = MessageType.CANCEL_TASK
    task_id: str = wire(f.Name())


@dataclasses.dataclass(frozen=True, kw_only=True)
class SetPriority(Message):
    TYPE = MessageType.SET_PRIORITY
    task_id: str = wire(f.Name())
    priority: int = wire(f.UInt(MAX_PRIORITY))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DownlinkResult(Message):
    """Ask for a finished task's TASK_RESULT (again: results stay until the payload prunes them)."""

    TYPE = MessageType.DOWNLINK_RESULT
    task_id: str = wire(f.Name())


def crc32c(data: bytes) -> int:
    return _crc32c_lib.crc32c(data)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageChunk(Message):
    """One piece of an image file. Every chunk repeats the file's size, chunk count and SHA-256,
    so whichever chunk completes the file (after a resumed upload, in any order) lets the payload
    check the whole file. `crc32c` covers `data` end to end, from the ground's file read to the
    payload's storage."""

    TYPE = MessageType.IMAGE_CHUNK
    image: str = wire(f.Name())
    index: int = wire(f.UInt(U32))
    total: int = wire(f.UInt(MAX_IMAGE_CHUNKS, minimum=1))
    offset: int = wire(f.UInt(U64))
    image_size: int = wire(f.UInt(U64, minimum=1))
    data: bytes = wire(f.Blob(MAX_CHUNK_DATA_BYTES, min_len=1))
    crc32c: int = wire(f.UInt(U32))
    sha256: bytes = wire(f.Digest(32))

    def _validate(self) -> None:
        if self.image_size > MAX_IMAGE_BYTES:
            raise WireError(
                ResponseCode.IMAGE_TOO_LARGE,
                f"image {self.image}: {self.image_size} bytes > {MAX_IMAGE_BYTES}",
                field="image_size",
            )
        if self.total > self.image_size:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                f"image {self.image}: {self.total} chunks for {self.image_size} bytes",
                field="total",
            )
        if self.index >= self.total:
            raise WireError(
                ResponseCode.CHUNK_OUT_OF_RANGE,
                f"image {self.image}: chunk {self.index} of {self.total}",
                field="index",
            )
        if self.offset + len(self.data) > self.image_size:
            raise WireError(
                ResponseCode.CHUNK_OUT_OF_RANGE,
                f"image {self.image}: bytes {self.offset}..{self.offset + len(self.data)} beyond {self.image_size}",
                field="offset",
            )
        actual = crc32c(self.data)
        if actual != self.crc32c:
            raise WireError(
                ResponseCode.CHUNK_CRC_MISMATCH,
                f"image {self.image} chunk {self.index}: crc32c {actual:#010x} != {self.crc32c:#010x}",
                field="crc32c",
            )

    @classmethod
    def split(cls, image: str, content: bytes, chunk_bytes: int = DEFAULT_CHUNK_DATA_BYTES) -> list[Self]:
        """Cut a file into chunks of `chunk_bytes` (the last one shorter)."""
        if not 1 <= chunk_bytes <= MAX_CHUNK_DATA_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_DATA_BYTES}")
        content = bytes(content)
        if not content:
            raise WireError(ResponseCode.BAD_FIELD_VALUE, f"image {image}: empty file", field="image_size")
        digest = hashlib.sha256(content).digest()
        total = math.ceil(len(content) / chunk_bytes)
        return [
            cls(
                image=image,
                index=i,
                total=total,
                offset=i * chunk_bytes,
                image_size=len(content),
                data=content[i * chunk_bytes : (i + 1) * chunk_bytes],
                crc32c=crc32c(content[i * chunk_bytes : (i + 1) * chunk_bytes]),
                sha256=digest,
            )
            for i in range(total)
        ]


def check_file_hash(content: bytes, sha256: bytes, image: str = "image") -> None:
    """Raise FILE_HASH_MISMATCH unless `content` hashes to `sha256` (run on the assembled file)."""
    actual = hashlib.sha256(content).digest()
    if actual != sha256:
        raise WireError(
            ResponseCode.FILE_HASH_MISMATCH,
            f"{image}: sha256 {actual.hex()[:16]}... != {bytes(sha256).hex()[:16]}...",
            field="sha256",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageQuery(Message):
    """Which chunks of this image does the payload hold? Answered with IMAGE_STATUS, so an upload
    resumes after link loss or a payload power cut by sending only the missing chunks."""

    TYPE = MessageType.IMAGE_QUERY
    image: str = wire(f.Name())


# --- verification reports (PUS service 1) -----------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verification(Message):
    """Common part of the verification reports: which telecommand they are about."""

    tc_apid: int = wire(f.UInt(0x7FF))
    tc_source: int = wire(f.UInt(U16))
    tc_seq: int = wire(f.UInt(SEQ_MAX))
    tc_type: int = wire(f.UInt(U16))
    task_id: str | None = wire(f.Optional(f.Name()), default=None)

    @property
    def request(self) -> RequestRef:
        return RequestRef(apid=self.tc_apid, source_id=self.tc_source, seq=self.tc_seq, message_type=self.tc_type)

    @classmethod
    def about(cls, request: RequestRef, **fields: Any) -> Self:
        return cls(
            tc_apid=request.apid,
            tc_source=request.source_id,
            tc_seq=request.seq,
            tc_type=request.message_type,
            **fields,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accepted(Verification):
    TYPE = MessageType.ACCEPTED


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rejected(Verification):
    """Acceptance failed. For REPLAYED_SEQUENCE, `highest_seq` is the highest sequence number the
    payload has accepted from this (APID, source), so the ground can resynchronise its counter."""

    TYPE = MessageType.REJECTED
    code: ResponseCode = wire(f.Choice(ResponseCode))
    reason: str = wire(f.Text(MAX_REASON_BYTES))
    highest_seq: int | None = wire(f.Optional(f.UInt(SEQ_MAX)), default=None)

    @classmethod
    def from_error(cls, error: WireError, request: RequestRef | None = None, task_id: str | None = None) -> Self:
        """The report for a WireError. A packet too short to name its telecommand is reported
        with all tc_ fields zero."""
        request = request or error.request or RequestRef(apid=0, source_id=0, seq=0, message_type=0)
        return cls.about(
            request,
            code=error.code,
            reason=error.reason,
            highest_seq=getattr(error, "highest", None),
            task_id=task_id,
        )

    @property
    def not_yet(self) -> bool:
        """RESULT_NOT_READY to a DOWNLINK_RESULT: the answer "this task has not finished yet" to a
        valid query, not a fault. Not counted in ERROR_COUNT; the ground shows it as NOT_READY,
        never as a rejection (wire-protocol.md §3.6)."""
        return self.code == ResponseCode.RESULT_NOT_READY and self.tc_type == MessageType.DOWNLINK_RESULT


@dataclasses.dataclass(frozen=True, kw_only=True)
class Started(Verification):
    TYPE = MessageType.STARTED


@dataclasses.dataclass(frozen=True, kw_only=True)
class Progress(Verification):
    TYPE = MessageType.PROGRESS
    phase: TaskPhase = wire(f.Choice(TaskPhase))
    done: int = wire(f.UInt(U32))
    total: int = wire(f.UInt(U32))

    def _validate(self) -> None:
        if self.done > self.total:
            raise WireError(ResponseCode.BAD_FIELD_VALUE, f"progress {self.done} > total {self.total}", field="done")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Completed(Verification):
    TYPE = MessageType.COMPLETED


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failed(Verification):
    TYPE = MessageType.FAILED
    code: ResponseCode = wire(f.Choice(ResponseCode))
    reason: str = wire(f.Text(MAX_REASON_BYTES))


# --- payload telemetry ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Housekeeping(Message):
    TYPE = MessageType.HOUSEKEEPING
    queue_depth: int = wire(f.UInt(U32), channel=TlmChannel.QUEUE_DEPTH)
    current_task: str | None = wire(f.Optional(f.Name()), channel=TlmChannel.CURRENT_TASK)
    phase: TaskPhase | None = wire(f.Optional(f.Choice(TaskPhase)), channel=TlmChannel.PHASE)
    progress_done: int = wire(f.UInt(U32), channel=TlmChannel.PROGRESS_DONE)
    progress_total: int = wire(f.UInt(U32), channel=TlmChannel.PROGRESS_TOTAL)
    checkpoint_bytes: int = wire(f.UInt(U64), channel=TlmChannel.CHECKPOINT_BYTES)
    disk_free_bytes: int = wire(f.UInt(U64), channel=TlmChannel.DISK_FREE_BYTES)
    boot_count: int = wire(f.UInt(U32), channel=TlmChannel.BOOT_COUNT)
    command_count: int = wire(f.UInt(U32), channel=TlmChannel.COMMAND_COUNT)
    error_count: int = wire(f.UInt(U32), channel=TlmChannel.ERROR_COUNT)
    uptime_s: float = wire(f.Float(0.0), channel=TlmChannel.UPTIME)
    storage_state: StorageState = wire(
        f.Choice(StorageState), channel=TlmChannel.STORAGE_STATE, default=StorageState.OK
    )
    #: the longest durable write (or fsync) since the last HOUSEKEEPING, or the one still running
    longest_write_s: float = wire(f.Float(0.0), channel=TlmChannel.LONGEST_WRITE, default=0.0)
    #: space the payload holds back for its own state, queue and health records
    reserve_bytes: int = wire(f.UInt(U64), channel=TlmChannel.RESERVE_BYTES, default=0)
    #: the payload process's resident memory; None: not measured (or an older payload)
    memory_rss_bytes: int | None = wire(f.Optional(f.UInt(U64)), channel=TlmChannel.MEMORY_RSS, default=None)
    #: bytes written through the payload's durable file layer since this boot (not over its
    #: life: a persisted counter would add the wear it measures; the ground sums over boots)
    written_bytes: int | None = wire(f.Optional(f.UInt(U64)), channel=TlmChannel.STORAGE_WRITTEN, default=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event(Message):
    """An event (F Prime style). `severity` is fixed per event id; it is sent so that tools that
    do not know an id can still rank it, and checked against the table on receipt."""

    TYPE = MessageType.EVENT
    event_id: EventId = wire(f.Choice(EventId))
    text: str = wire(f.Text(MAX_EVENT_TEXT_BYTES))
    task_id: str | None = wire(f.Optional(f.Name()), default=None)
    severity: Severity | None = wire(f.Optional(f.Choice(Severity)), default=None)

    def _validate(self) -> None:
        if self.severity is None:
            object.__setattr__(self, "severity", self.event_id.severity)
        elif self.severity != self.event_id.severity:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                f"event {self.event_id.name} has severity {self.event_id.severity.name}, not {self.severity.name}",
                field="severity",
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskResult(Message):
    TYPE = MessageType.TASK_RESULT
    task_id: str = wire(f.Name())
    token_ids: Sequence[int] = wire(f.ListOf(f.UInt(U32), MAX_NEW_TOKENS))
    text: str = wire(f.Text(MAX_RESULT_TEXT_BYTES))
    #: SHA-256 over the generated logits, for bitwise comparisons between runs.
    logits_sha256: bytes = wire(f.Digest(32))
    #: Phase name -> seconds (e.g. vision, prefill, decode, recovery, total).
    timings: Mapping[str, float] = wire(f.MapOf(f.Name(), f.Float(0.0), MAX_TIMINGS))
    #: Power cuts the task survived.
    interruptions: int = wire(f.UInt(U32), default=0)
    # Later fields, nil by default so an older report still decodes (docs/wire-protocol.md §3.3):
    #: Per restart of the task's request, oldest first: seconds it took to find where to resume,
    #: the phase it resumed in, the recovery planner its plan used (three arrays of one length).
    recovery_s: Sequence[float] | None = wire(f.Optional(f.ListOf(f.Float(0.0), MAX_RECOVERIES)), default=None)
    recovery_phases: Sequence[str] | None = wire(f.Optional(f.ListOf(f.Name(), MAX_RECOVERIES)), default=None)
    recovery_planners: Sequence[str] | None = wire(f.Optional(f.ListOf(f.Name(), MAX_RECOVERIES)), default=None)
    #: Bytes of checkpoint records the request wrote over its whole life, every boot included.
    written_bytes: int | None = wire(f.Optional(f.UInt(U64)), default=None)

    def _validate(self) -> None:
        lists = {"recovery_s": self.recovery_s, "recovery_phases": self.recovery_phases}
        lists["recovery_planners"] = self.recovery_planners
        given = {name: len(value) for name, value in lists.items() if value is not None}
        if given and (len(given) != len(lists) or len(set(given.values())) != 1):
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                "recovery_s, recovery_phases and recovery_planners come together, of one length: "
                + ", ".join(f"{name} {given.get(name, 'nil')}" for name in lists),
                field=next(name for name in lists if given.get(name) != max(given.values(), default=0)),
            )

    @property
    def recoveries(self) -> list[tuple[float, str, str]] | None:
        """(seconds, phase, planner) per restart, oldest first; None when not reported."""
        if self.recovery_s is None or self.recovery_phases is None or self.recovery_planners is None:
            return None
        return list(zip(self.recovery_s, self.recovery_phases, self.recovery_planners, strict=True))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    TYPE = MessageType.HEARTBEAT
    boot_count: int = wire(f.UInt(U32), channel=TlmChannel.BOOT_COUNT)
    uptime_s: float = wire(f.Float(0.0), channel=TlmChannel.UPTIME)
    current_task: str | None = wire(f.Optional(f.Name()), default=None, channel=TlmChannel.CURRENT_TASK)
    phase: TaskPhase | None = wire(f.Optional(f.Choice(TaskPhase)), default=None, channel=TlmChannel.PHASE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pong(Message):
    TYPE = MessageType.PONG
    key: int = wire(f.UInt(U32))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageStatus(Message):
    """Which chunks of an image the payload holds. `received` is a bitmap, bit i (LSB first
    within each byte) set when chunk i is stored; an image the payload has never seen has
    total 0 and an empty bitmap. `verified`: the assembled file matched its SHA-256."""

    TYPE = MessageType.IMAGE_STATUS
    image: str = wire(f.Name())
    image_size: int = wire(f.UInt(MAX_IMAGE_BYTES))
    total: int = wire(f.UInt(MAX_IMAGE_CHUNKS))
    received: bytes = wire(f.Blob((MAX_IMAGE_CHUNKS + 7) // 8))
    verified: bool = wire(f.Bool())

    def _validate(self) -> None:
        if len(self.received) != (self.total + 7) // 8:
            raise WireError(
                ResponseCode.BAD_FIELD_VALUE,
                f"bitmap of {len(self.received)} bytes for {self.total} chunks",
                field="received",
            )
        if self.total % 8 and self.received[-1] >> (self.total % 8):
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "bitmap marks chunks beyond total", field="received")
        if self.verified and not self.complete:
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "verified but chunks missing", field="verified")

    @classmethod
    def of(cls, image: str, image_size: int, total: int, received_indices, verified: bool = False) -> Self:
        bitmap = bytearray((total + 7) // 8)
        for i in received_indices:
            if not 0 <= i < total:
                raise WireError(ResponseCode.CHUNK_OUT_OF_RANGE, f"chunk {i} of {total}", field="received")
            bitmap[i // 8] |= 1 << (i % 8)
        return cls(image=image, image_size=image_size, total=total, received=bytes(bitmap), verified=verified)

    def has(self, index: int) -> bool:
        return 0 <= index < self.total and bool(self.received[index // 8] >> (index % 8) & 1)

    def missing(self) -> list[int]:
        return [i for i in range(self.total) if not self.has(i)]

    @property
    def complete(self) -> bool:
        return self.total > 0 and not self.missing()


# --- bus telemetry ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerReport(Message):
    TYPE = MessageType.POWER
    trace_time_s: float = wire(f.Float(0.0))
    payload_on: bool = wire(f.Bool(), channel=TlmChannel.PAYLOAD_ON)
    bus_voltage_v: float = wire(f.Float(0.0), channel=TlmChannel.BUS_VOLTAGE)
    payload_power_w: float = wire(f.Float(0.0), channel=TlmChannel.PAYLOAD_POWER)
    battery_soc: float = wire(f.Float(0.0, 1.0), channel=TlmChannel.BATTERY_SOC)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThermalReport(Message):
    TYPE = MessageType.THERMAL
    trace_time_s: float = wire(f.Float(0.0))
    payload_temp_c: float = wire(f.Float(-273.15), channel=TlmChannel.PAYLOAD_TEMPERATURE)
    bus_temp_c: float = wire(f.Float(-273.15), channel=TlmChannel.BUS_TEMPERATURE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FdirReport(Message):
    TYPE = MessageType.FDIR
    trace_time_s: float = wire(f.Float(0.0))
    mode: FdirMode = wire(f.Choice(FdirMode), channel=TlmChannel.FDIR_MODE)
    fault_count: int = wire(f.UInt(U32), channel=TlmChannel.FAULT_COUNT)
    last_fault: str | None = wire(f.Optional(f.Text(MAX_EVENT_TEXT_BYTES)), default=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShutdownWarning(Message):
    """The bus will cut payload power in `lead_time_s` (trace time) for `cause`."""

    TYPE = MessageType.SHUTDOWN_WARNING
    trace_time_s: float = wire(f.Float(0.0))
    lead_time_s: float = wire(f.Float(0.0))
    cause: PowerCause = wire(f.Choice(PowerCause))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PowerStateChange(Message):
    """Power went off or on. Sent to the payload when it connects after a power-up, with
    `after_fault`: whether the bus cut its previous power because the payload itself failed
    (exited on its own, stopped its heartbeat, never finished booting) rather than for a
    trace cut, a command or a bus restart. The payload's health and safety counts only such
    exits against the item it was handling (docs/flight.md)."""

    TYPE = MessageType.POWER_STATE
    trace_time_s: float = wire(f.Float(0.0))
    payload_on: bool = wire(f.Bool(), channel=TlmChannel.PAYLOAD_ON)
    cause: PowerCause = wire(f.Choice(PowerCause))
    after_fault: bool | None = wire(f.Optional(f.Bool()), default=None)


# --- health and safety, journal integrity -----------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ListQuarantine(Message):
    """Which commands, tasks and reports has the payload quarantined? Answered by QUARANTINE_LIST."""

    TYPE = MessageType.LIST_QUARANTINE


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReleaseQuarantine(Message):
    """Take an item out of quarantine: a task is queued again, a report is sent again, a
    command is handled again the next time it arrives. NOT_QUARANTINED if it is not held."""

    TYPE = MessageType.RELEASE_QUARANTINE
    item: str = wire(f.Text(MAX_ITEM_BYTES, min_chars=1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ListLostTasks(Message):
    """Which tasks did the payload lose to storage damage? Answered by LOST_TASKS."""

    TYPE = MessageType.LIST_LOST_TASKS


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuarantineList(Message):
    """Quarantined items, most recent first: `items[i]` died `exits[i]` times, `reasons[i]` says
    where. `total` counts every quarantined item (the list holds at most 64)."""

    TYPE = MessageType.QUARANTINE_LIST
    items: Sequence[str] = wire(f.ListOf(f.Text(MAX_ITEM_BYTES), MAX_LISTED_ITEMS))
    exits: Sequence[int] = wire(f.ListOf(f.UInt(U32), MAX_LISTED_ITEMS))
    reasons: Sequence[str] = wire(f.ListOf(f.Text(MAX_REASON_BYTES), MAX_LISTED_ITEMS))
    total: int = wire(f.UInt(U32))

    def _validate(self) -> None:
        if not len(self.items) == len(self.exits) == len(self.reasons):
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "items, exits and reasons differ in length", field="items")
        if self.total < len(self.items):
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "total below the items listed", field="total")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LostTasks(Message):
    """Tasks whose state the payload lost to storage damage, most recent first (at most 256 of
    `total`), with what its journal reader dropped: `bytes_dropped` in `records_dropped`
    damaged regions, of which `unnamed` held tasks it could not name."""

    TYPE = MessageType.LOST_TASKS
    task_ids: Sequence[str] = wire(f.ListOf(f.Name(), MAX_LISTED_TASKS))
    total: int = wire(f.UInt(U32))
    bytes_dropped: int = wire(f.UInt(U64))
    records_dropped: int = wire(f.UInt(U32))
    unnamed: int = wire(f.UInt(U32))

    def _validate(self) -> None:
        if self.total < len(self.task_ids):
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "total below the tasks listed", field="total")


# --- the bus's own telecommand ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class PayloadRetry(Message):
    """Addressed to the bus (APID BUS), not the payload: power the payload again now that the
    bus's boot-loop guard holds it off (docs/bus.md §6). Answered by the bus: ACCEPTED and
    COMPLETED, or REJECTED NOT_HELD when nothing is held."""

    TYPE = MessageType.PAYLOAD_RETRY


@dataclasses.dataclass(frozen=True, kw_only=True)
class PayloadProfile(Message):
    """What the payload's own process measured of its work (the completion forecast's rates):
    seconds per PROGRESS unit of each phase (`unit_s`), the units of each phase of its last task
    and the answer tokens it was asked for, the units between durable records (`durable_every`),
    the overhead of a power-up (process start to the first unit of work, median over the boots
    measured) and a task's setup. Sent at power-on and after each task."""

    TYPE = MessageType.PAYLOAD_PROFILE
    model: str = wire(f.Text(MAX_PROFILE_TEXT_BYTES))
    policy: str = wire(f.Text(MAX_PROFILE_TEXT_BYTES))
    cadence: str = wire(f.Text(MAX_PROFILE_TEXT_BYTES))
    unit_s: Mapping[str, float] = wire(f.MapOf(f.Name(), f.Float(0.0), MAX_PROFILE_PHASES))
    task_units: Mapping[str, int] = wire(f.MapOf(f.Name(), f.UInt(U32), MAX_PROFILE_PHASES))
    durable_every: Mapping[str, int] = wire(f.MapOf(f.Name(), f.UInt(U32), MAX_PROFILE_PHASES))
    decode_tokens: int = wire(f.UInt(U32))
    overhead_s: float = wire(f.Float(0.0))
    setup_s: float = wire(f.Float(0.0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowHistory(Message):
    """The power windows the payload has lived through, oldest first (at most 256): when each
    started (`starts`, the payload's clock, Unix seconds) and how long each ended one lasted
    (`lengths[i]` of `starts[i]`; the newest window, still open, has none). Sent at power-on."""

    TYPE = MessageType.WINDOW_HISTORY
    boot_count: int = wire(f.UInt(U32))
    starts: Sequence[float] = wire(f.ListOf(f.Float(0.0), MAX_HISTORY_WINDOWS))
    lengths: Sequence[float] = wire(f.ListOf(f.Float(0.0), MAX_HISTORY_WINDOWS))

    def _validate(self) -> None:
        if len(self.lengths) not in (len(self.starts), len(self.starts) - 1) and self.starts:
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "one length per ended window", field="lengths")
        if list(self.starts) != sorted(self.starts):
            raise WireError(ResponseCode.BAD_FIELD_VALUE, "window starts out of order", field="starts")


_missing = set(MessageType) - set(_REGISTRY)
if _missing:  # pragma: no cover - caught at import by every test
    raise TypeError(f"message types without a class: {sorted(t.name for t in _missing)}")
