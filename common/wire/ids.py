"""Every number the wire protocol gives a meaning to, declared once.

F Prime style: application process IDs, message types (command opcodes and report/telemetry
types), response codes, event IDs with their severities and telemetry channel IDs are fixed
integers. They are part of the protocol: never renumber a member, only add new ones (and the
matching row in docs/wire-protocol.md, which a test keeps in step with this module).
"""

from __future__ import annotations

import enum
from typing import Final

# --- framing limits ---------------------------------------------------------------------------

#: Version of the OrbitWeaver secondary header and body conventions (secondary header byte 0).
WIRE_VERSION: Final[int] = 1
#: CCSDS primary header, always 6 bytes.
PRIMARY_HEADER_BYTES: Final[int] = 6
#: OrbitWeaver secondary header (see docs/wire-protocol.md §2.2).
SECONDARY_HEADER_BYTES: Final[int] = 16
#: CRC-16/CCITT-FALSE packet error control field.
CRC_BYTES: Final[int] = 2
#: CCSDS packet data length is a 16-bit "length minus one", so a packet is at most 65542 bytes.
MAX_PACKET_BYTES: Final[int] = PRIMARY_HEADER_BYTES + 0x10000
#: Smallest body is an empty msgpack map (one byte).
MIN_PACKET_BYTES: Final[int] = PRIMARY_HEADER_BYTES + SECONDARY_HEADER_BYTES + 1 + CRC_BYTES
MAX_BODY_BYTES: Final[int] = MAX_PACKET_BYTES - PRIMARY_HEADER_BYTES - SECONDARY_HEADER_BYTES - CRC_BYTES

# --- sequence numbers -------------------------------------------------------------------------

#: The CCSDS primary header holds the low 14 bits of a sender's sequence number ...
SEQ_COUNT_BITS: Final[int] = 14
#: ... and the secondary header the 16-bit epoch above them (how often the count has wrapped).
SEQ_EPOCH_BITS: Final[int] = 16
SEQ_BITS: Final[int] = SEQ_COUNT_BITS + SEQ_EPOCH_BITS
#: Sequence numbers are 30-bit and compared with serial-number arithmetic modulo this.
SEQ_MODULUS: Final[int] = 1 << SEQ_BITS
SEQ_MAX: Final[int] = SEQ_MODULUS - 1

# --- field limits -----------------------------------------------------------------------------

#: Task ids, image names, timing names: [A-Za-z0-9][A-Za-z0-9._-]*, at most this many characters.
MAX_NAME_CHARS: Final[int] = 64
MAX_PROMPT_BYTES: Final[int] = 8192
MAX_IMAGES_PER_TASK: Final[int] = 8
MAX_NEW_TOKENS: Final[int] = 1024
MAX_PRIORITY: Final[int] = 255
#: Image data carried by one IMAGE_CHUNK; leaves room for the other fields under MAX_BODY_BYTES.
MAX_CHUNK_DATA_BYTES: Final[int] = 60 * 1024
#: Chunk size the ground uses unless told otherwise.
DEFAULT_CHUNK_DATA_BYTES: Final[int] = 32 * 1024
MAX_IMAGE_BYTES: Final[int] = 16 * 1024 * 1024
#: Bounds IMAGE_STATUS's received-chunk bitmap to 512 bytes; a 16 MiB image then needs chunks of
#: at least 4 KiB.
MAX_IMAGE_CHUNKS: Final[int] = 4096
MAX_RESULT_TEXT_BYTES: Final[int] = 32 * 1024
MAX_EVENT_TEXT_BYTES: Final[int] = 512
MAX_REASON_BYTES: Final[int] = 256
MAX_TIMINGS: Final[int] = 32
#: Restarts a TASK_RESULT lists (the latest ones; `interruptions` counts every cut).
MAX_RECOVERIES: Final[int] = 256

# --- health and safety, journal integrity, image and sequence limits (one block) ----------------

#: Telecommand sequence numbers more than this far ahead of the highest accepted one are refused
#: (SEQUENCE_TOO_FAR_AHEAD, docs/wire-protocol.md §6.3): an old frame can come back as "fresh"
#: only after 2^30 / FORWARD_WINDOW accepted commands, never after one forward jump.
SEQ_FORWARD_WINDOW: Final[int] = 4096
#: Pixels an uploaded picture may declare in its header (width x height), any format.
MAX_IMAGE_PIXELS: Final[int] = 100_000_000
#: Bytes the payload may spend decoding one picture at the resolution it decodes it (JPEG
#: decodes at a reduced scale, other formats at full size), checked from the header before
#: decoding. 160 MiB: a 40-megapixel RGBA picture.
MAX_DECODE_BYTES: Final[int] = 160 * 1024 * 1024
#: Longest side over shortest side that the Qwen-VL image processors accept (smart_resize).
MAX_ASPECT_RATIO: Final[int] = 200
#: Quarantine item ids ("task:<id>", "report:<id>", "command:<TYPE>:<digest>").
MAX_ITEM_BYTES: Final[int] = 128
#: Entries one QUARANTINE_LIST or LOST_TASKS report carries (the most recent first).
MAX_LISTED_ITEMS: Final[int] = 64
MAX_LISTED_TASKS: Final[int] = 256
#: Windows one WINDOW_HISTORY carries (the payload's window log keeps as many).
MAX_HISTORY_WINDOWS: Final[int] = 256
#: PAYLOAD_PROFILE: entries of its per-phase maps, and bytes of its model/policy/cadence names.
MAX_PROFILE_PHASES: Final[int] = 8
MAX_PROFILE_TEXT_BYTES: Final[int] = 128


# --- addressing -------------------------------------------------------------------------------


class Apid(enum.IntEnum):
    """CCSDS application process IDs (11 bits). A telecommand carries the APID of the process it
    is addressed to; telemetry carries the APID of the process that produced it."""

    BUS = 0x010
    PAYLOAD = 0x020
    #: CCSDS idle packets; never used for OrbitWeaver messages.
    IDLE = 0x7FF


class NodeId(enum.IntEnum):
    """Secondary-header source id: which node produced a packet. Further ground stations take
    0x0002..0x00FF (admin 0x0001..0x000F, stations 0x0010..0x00FF: ADMIN_SOURCE_IDS,
    STATION_SOURCE_IDS); each keeps its own sequence counter and gets its own replay window."""

    GROUND = 0x0001
    BUS = 0x0100
    PAYLOAD = 0x0200


#: Ground source ids (docs/wire-protocol.md §5.1), each bound by the bus to one station key:
#: 0x0001..0x000F are admin stations (the operations centre: they may act on every task),
#: 0x0010..0x00FF ordinary stations (they act on the tasks they uplinked, and on no other).
ADMIN_SOURCE_IDS = range(0x0001, 0x0010)
STATION_SOURCE_IDS = range(0x0010, 0x0100)
GROUND_SOURCE_IDS = range(0x0001, 0x0100)


def is_admin_source(source_id: int) -> bool:
    """Whether a telecommand from this source id may act on every station's tasks."""
    return source_id in ADMIN_SOURCE_IDS


class AckFlags(enum.IntFlag):
    """Which successful verification reports a telecommand asks for (PUS-1 acknowledgement
    flags). Rejections and failures are always reported."""

    NONE = 0
    ACCEPTANCE = 0x1
    START = 0x2
    PROGRESS = 0x4
    COMPLETION = 0x8
    ALL = 0xF


# --- message types ----------------------------------------------------------------------------


class MessageType(enum.IntEnum):
    """Secondary-header message type. Telecommand types are the command opcodes.

    0x01xx telecommands (ground -> payload; PAYLOAD_RETRY ground -> bus); 0x02xx verification
    reports, whose low byte is the PUS service 1 subtype; 0x03xx payload telemetry; 0x04xx bus
    telemetry.
    """

    PING = 0x0101
    STATUS = 0x0102
    UPLINK_TASK = 0x0110
    CANCEL_TASK = 0x0111
    SET_PRIORITY = 0x0112
    DOWNLINK_RESULT = 0x0113
    IMAGE_CHUNK = 0x0120
    IMAGE_QUERY = 0x0121

    ACCEPTED = 0x0201
    REJECTED = 0x0202
    STARTED = 0x0203
    PROGRESS = 0x0205
    COMPLETED = 0x0207
    FAILED = 0x0208

    HOUSEKEEPING = 0x0301
    EVENT = 0x0302
    TASK_RESULT = 0x0303
    HEARTBEAT = 0x0304
    PONG = 0x0305
    IMAGE_STATUS = 0x0306

    POWER = 0x0401
    THERMAL = 0x0402
    FDIR = 0x0403
    SHUTDOWN_WARNING = 0x0404
    POWER_STATE = 0x0405

    # health and safety, journal integrity
    LIST_QUARANTINE = 0x0114
    RELEASE_QUARANTINE = 0x0115
    LIST_LOST_TASKS = 0x0116
    QUARANTINE_LIST = 0x0307
    LOST_TASKS = 0x0308

    # the completion forecast's inputs (docs/ground.md)
    PAYLOAD_PROFILE = 0x0309
    WINDOW_HISTORY = 0x030A

    # the bus's own telecommand (APID BUS): the boot-loop guard's retry
    PAYLOAD_RETRY = 0x0130

    @property
    def is_command(self) -> bool:
        return 0x0100 <= self.value < 0x0200


# --- response codes ---------------------------------------------------------------------------


class ResponseCode(enum.IntEnum):
    """Why a command was rejected or failed (REJECTED/FAILED `code`, WireError.code).

    Each class of bad input has its own code so that an operator can tell them apart from the
    report alone. 1xx packet layer, 2xx message body, 3xx security, 4xx images, 5xx task
    management, 6xx execution.
    """

    description: str

    # The default only lets a type checker accept the lookup `ResponseCode(value)`, which never
    # calls __new__ (every member is declared with its description below).
    def __new__(cls, value: int, description: str = "") -> ResponseCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.description = description
        return member

    OK = 0, "no error"

    MALFORMED_PACKET = 100, "packet structure broken: too short, flags wrong, reserved bits set"
    OVERSIZED_PACKET = 101, "packet larger than the CCSDS maximum of 65542 bytes"
    BAD_LENGTH = 102, "CCSDS packet data length disagrees with the bytes received"
    BAD_CRC = 103, "CRC-16/CCITT-FALSE packet error control field does not check"
    BAD_VERSION = 104, "CCSDS version or OrbitWeaver wire version not supported"
    WRONG_PACKET_TYPE = 105, "telecommand type in a telemetry packet or the reverse"
    WRONG_APID = 106, "packet addressed to another application process"

    UNKNOWN_COMMAND = 200, "telecommand opcode not known"
    UNKNOWN_MESSAGE_TYPE = 201, "telemetry message type not known"
    BODY_UNDECODABLE = 202, "body is not exactly one msgpack map"
    MISSING_FIELD = 203, "a required field is absent"
    UNEXPECTED_FIELD = 204, "a field not defined for this message type is present"
    BAD_FIELD_TYPE = 205, "a field has the wrong type"
    BAD_FIELD_VALUE = 206, "a field is out of range or inconsistent with another"
    FIELD_TOO_LONG = 207, "a string, byte string, list or map exceeds its limit"
    INVALID_UTF8 = 208, "a string is not valid UTF-8"
    PATH_LIKE_NAME = 209, "a name contains a path separator, '..', NUL, ':' or a leading '.'"
    BAD_NAME = 210, "a name is empty, too long or uses characters outside [A-Za-z0-9._-]"

    REPLAYED_SEQUENCE = 300, "sequence number already accepted or older than the replay window"
    UNAUTHENTICATED = 301, "sender not authenticated by CurveZMQ"
    NOT_AUTHORIZED = 302, "authenticated sender may not send this message"

    IMAGE_TOO_LARGE = 400, "declared image size exceeds the payload limit"
    IMAGE_UNDECODABLE = 401, "assembled image is not a decodable picture"
    CHUNK_CRC_MISMATCH = 402, "CRC-32C of chunk data does not match the chunk's crc32c field"
    FILE_HASH_MISMATCH = 403, "SHA-256 of the assembled image does not match"
    CHUNK_OUT_OF_RANGE = 404, "chunk index or byte range outside the declared image"
    CHUNK_CONFLICT = 405, "chunk disagrees with earlier chunks of the same image"
    UNKNOWN_IMAGE = 406, "image not present on the payload"
    IMAGE_INCOMPLETE = 407, "image still has missing chunks"

    QUEUE_FULL = 500, "task queue is full"
    UNKNOWN_TASK = 501, "no task with this id"
    DUPLICATE_TASK = 502, "a task with this id already exists"
    TASK_FINISHED = 503, "task already finished; it cannot be changed"
    RESULT_NOT_READY = 504, "task has no result yet"
    STORAGE_FULL = 505, "payload storage is full"
    BUSY = 506, "payload cannot take this command now"

    INFERENCE_ERROR = 600, "inference failed"
    CANCELLED = 601, "task cancelled by command"
    CHECKPOINT_ERROR = 602, "checkpoint store failed"
    INTERNAL_ERROR = 699, "unexpected internal error"

    # health and safety, journal integrity, uplink checks
    EMPTY_PROMPT = 211, "prompt has no visible character: empty, or only whitespace, control or format characters"
    SEQUENCE_TOO_FAR_AHEAD = 303, "sequence number further ahead of the highest accepted than the forward window"
    IMAGE_SHAPE_UNSUPPORTED = 408, "image dimensions or aspect ratio the model's image processor cannot take"
    IMAGE_CORRUPT = 409, "a stored image no longer matches its SHA-256; the ground must send it again"
    QUARANTINED = 507, "command, task or report quarantined after repeated abnormal exits"
    NOT_QUARANTINED = 508, "no quarantined item with this id"
    TASK_LOST = 509, "task state lost to storage damage; the task is not run again silently"
    RESULT_EVICTED = 510, "result removed under the payload's results retention budget"
    HANDLER_FAULT = 603, "the command's handler failed unexpectedly; the payload kept running"

    # storage as an environment condition, stations, the bus's own limits
    NOT_OWNER = 304, "the task belongs to another station; only its own station or an admin station may act on it"
    SOURCE_NOT_BOUND = 305, "the packet's source id is not the one bound to the sender's key"
    STORAGE_READ_ONLY = 511, "payload storage refuses writes (read-only)"
    STORAGE_ERROR = 512, "payload storage reports I/O errors"
    BUS_STORAGE_FULL = (
        513,
        "the bus cannot store the command: its own disk is full (or read-only, or failing; or its store is at "
        "its cap: the reason says which)",
    )
    STATION_QUOTA = 514, "the station already has its maximum of commands stored on the bus"
    RATE_LIMITED = 515, "the station sends commands faster than its rate limit"
    NOT_HELD = 516, "the payload is not held off by the boot-loop guard"


# --- events -----------------------------------------------------------------------------------


class Severity(enum.IntEnum):
    """Event severities, numbered as F Prime's Fw::LogSeverity."""

    FATAL = 1
    WARNING_HI = 2
    WARNING_LO = 3
    COMMAND = 4
    ACTIVITY_HI = 5
    ACTIVITY_LO = 6
    DIAGNOSTIC = 7


class EventId(enum.IntEnum):
    """Payload and bus events; each has one fixed severity (`EventId.X.severity`)."""

    severity: Severity

    def __new__(cls, value: int, severity: Severity) -> EventId:
        member = int.__new__(cls, value)
        member._value_ = value
        member.severity = severity
        return member

    BOOT = 0x0001, Severity.ACTIVITY_HI
    UNCLEAN_SHUTDOWN_DETECTED = 0x0002, Severity.WARNING_LO
    SHUTDOWN_WARNING_RECEIVED = 0x0003, Severity.WARNING_LO
    STATE_RESTORED = 0x0004, Severity.ACTIVITY_HI
    STATE_CORRUPT = 0x0005, Severity.WARNING_HI

    COMMAND_ACCEPTED = 0x0100, Severity.COMMAND
    COMMAND_REJECTED = 0x0101, Severity.WARNING_LO
    REPLAY_DETECTED = 0x0102, Severity.WARNING_HI
    AUTH_DENIED = 0x0103, Severity.WARNING_HI

    TASK_QUEUED = 0x0200, Severity.ACTIVITY_LO
    TASK_STARTED = 0x0201, Severity.ACTIVITY_HI
    TASK_PHASE = 0x0202, Severity.ACTIVITY_LO
    TASK_RESUMED = 0x0203, Severity.ACTIVITY_HI
    TASK_COMPLETED = 0x0204, Severity.ACTIVITY_HI
    TASK_FAILED = 0x0205, Severity.WARNING_HI
    TASK_CANCELLED = 0x0206, Severity.ACTIVITY_HI
    TASK_RESTARTED_FROM_SCRATCH = 0x0207, Severity.WARNING_LO

    CHECKPOINT_WRITTEN = 0x0300, Severity.DIAGNOSTIC
    CHECKPOINT_CORRUPT = 0x0301, Severity.WARNING_LO
    CHECKPOINT_MANIFEST_MISMATCH = 0x0302, Severity.WARNING_HI
    RECOVERY_PLANNED = 0x0303, Severity.ACTIVITY_LO

    IMAGE_COMPLETE = 0x0400, Severity.ACTIVITY_LO
    IMAGE_REJECTED = 0x0401, Severity.WARNING_LO

    DISK_LOW = 0x0500, Severity.WARNING_LO
    DISK_FULL = 0x0501, Severity.WARNING_HI
    THERMAL_LIMIT = 0x0502, Severity.WARNING_HI
    FATAL_ERROR = 0x05FF, Severity.FATAL

    # health and safety, journal integrity
    COMMAND_FAULT = 0x0600, Severity.WARNING_HI
    MAIN_LOOP_FAULT = 0x0601, Severity.WARNING_HI
    WORKER_FAULT = 0x0602, Severity.WARNING_HI
    REPORT_FAULT = 0x0603, Severity.WARNING_HI
    ABNORMAL_EXIT = 0x0604, Severity.WARNING_HI
    ITEM_QUARANTINED = 0x0605, Severity.WARNING_HI
    QUARANTINE_RELEASED = 0x0606, Severity.ACTIVITY_HI
    JOURNAL_CORRUPT = 0x0607, Severity.WARNING_HI
    TASKS_LOST = 0x0608, Severity.WARNING_HI
    RESULT_EVICTED = 0x0609, Severity.ACTIVITY_LO
    IMAGE_CORRUPT = 0x060A, Severity.WARNING_HI

    # storage as an environment condition (payload), boot-time faults
    STORAGE_FULL = 0x060B, Severity.WARNING_HI
    STORAGE_READ_ONLY = 0x060C, Severity.WARNING_HI
    STORAGE_ERROR = 0x060D, Severity.WARNING_HI
    STORAGE_RESTORED = 0x060E, Severity.ACTIVITY_HI
    STORAGE_STALL = 0x060F, Severity.WARNING_LO
    BOOT_FAULT = 0x0610, Severity.WARNING_HI

    # the bus's own events (source BUS): boot-loop guard, its storage, stations
    PAYLOAD_BOOT_LOOP = 0x0700, Severity.WARNING_HI
    PAYLOAD_RETRY = 0x0701, Severity.ACTIVITY_HI
    BUS_STORAGE_FULL = 0x0702, Severity.WARNING_HI
    BUS_STORAGE_RESTORED = 0x0703, Severity.ACTIVITY_HI
    STATION_THROTTLED = 0x0704, Severity.WARNING_LO
    KEY_REVOKED = 0x0705, Severity.ACTIVITY_HI


# --- telemetry channels -----------------------------------------------------------------------


class TlmChannel(enum.IntEnum):
    """Telemetry channels (F Prime style): each is one field of a telemetry message, so that
    ground tools can plot and limit-check by channel id. `unit` is SI or a count."""

    unit: str

    def __new__(cls, value: int, unit: str) -> TlmChannel:
        member = int.__new__(cls, value)
        member._value_ = value
        member.unit = unit
        return member

    QUEUE_DEPTH = 0x0101, "tasks"
    CURRENT_TASK = 0x0102, "name"
    PHASE = 0x0103, "phase"
    PROGRESS_DONE = 0x0104, "units"
    PROGRESS_TOTAL = 0x0105, "units"
    CHECKPOINT_BYTES = 0x0106, "B"
    DISK_FREE_BYTES = 0x0107, "B"
    BOOT_COUNT = 0x0108, "boots"
    COMMAND_COUNT = 0x0109, "commands"
    ERROR_COUNT = 0x010A, "errors"
    UPTIME = 0x010B, "s"
    STORAGE_STATE = 0x010C, "state"
    LONGEST_WRITE = 0x010D, "s"
    RESERVE_BYTES = 0x010E, "B"
    MEMORY_RSS = 0x010F, "B"
    STORAGE_WRITTEN = 0x0110, "B"

    BUS_VOLTAGE = 0x0401, "V"
    PAYLOAD_POWER = 0x0402, "W"
    BATTERY_SOC = 0x0403, "fraction"
    PAYLOAD_ON = 0x0404, "bool"
    PAYLOAD_TEMPERATURE = 0x0411, "degC"
    BUS_TEMPERATURE = 0x0412, "degC"
    FDIR_MODE = 0x0421, "mode"
    FAULT_COUNT = 0x0422, "faults"


# --- enumerated field values ------------------------------------------------------------------


class TaskPhase(enum.StrEnum):
    """Where a task is; carried as a string in PROGRESS, HOUSEKEEPING and HEARTBEAT."""

    QUEUED = "queued"
    RECOVERING = "recovering"
    VISION = "vision"
    PREFILL = "prefill"
    DECODE = "decode"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class PowerCause(enum.StrEnum):
    """Why the bus warns of, or performs, a payload power change."""

    ECLIPSE = "eclipse"
    LOW_BATTERY = "low_battery"
    THERMAL = "thermal"
    FDIR = "fdir"
    COMMANDED = "commanded"
    TRACE = "trace"
    RESTORED = "restored"


class StorageState(enum.StrEnum):
    """What the payload's data storage lets it do (HOUSEKEEPING `storage_state`, docs/flight.md
    "Storage"): `ok`; `full` (no space beyond the payload's reserve: new uplinks and images are
    refused, checkpoints skipped); `read_only` (no write succeeds); `error` (writes fail with I/O
    errors)."""

    OK = "ok"
    FULL = "full"
    READ_ONLY = "read_only"
    ERROR = "error"


class FdirMode(enum.StrEnum):
    NOMINAL = "nominal"
    DEGRADED = "degraded"
    SAFE = "safe"
