"""The console's aiohttp application.

    GET  /                      the page (static/index.html)
    GET  /static/<file>         its script, style and the vendored uPlot
    GET  /api/info              read-only?, station, series names, time span
    GET  /api/stream            server-sent events: every packet and command as it comes, and an
                                uplink's progress to the payload (UPLOAD records)
    GET  /api/events            events, paged (?after=N&limit=L&kind=A,B)
    GET  /api/timeline          windows, cuts, boots in ?t0&t1 (thinned past 2,000 marks), the span
    GET  /api/telemetry         series in ?t0&t1 decimated to ?buckets (min and max per bucket)
    GET  /api/telemetry.csv     the same range, every sample (?series=a,b)
    GET  /api/tasks             the station's tasks, their results, and the completion forecast
    POST /api/uploads           JSON {name, size, sha256}: make a resumable upload, or say its offset
    PUT  /api/uploads/<sha256>  one chunk at Upload-Offset, with its Chunk-SHA256 (uploads.py)
    POST /api/uplink            JSON naming completed uploads, or multipart: prompt,
                                max_new_tokens, priority, image (1..n)
    POST /api/tasks/{id}/cancel | priority | resend,  POST /api/quarantine/{item}/release

POSTs and PUTs need the token and a same-origin `Origin` (security.py), and are refused on a
`--read-only` console. Each action opens its own GroundClient, exactly as the CLI command does,
so the same checks run and the same messages come back (HTTP 400 with the CLI's text).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import signal
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, ClientPayloadError, web

from ground.console.command_log import CommandLogReader
from ground.console.history import SERIES_NAMES, History, WrittenStore
from ground.console.security import TOKEN_HEADER, ConsoleSecurity
from ground.console.uploads import MAX_CHUNK_BYTES, UploadError, UploadStore
from ground.errors import GroundError, LocalInputError
from ground.forecast import forecast_tasks
from ground.report import ROUTINE_TYPES, RoutineFilter

STATIC = Path(__file__).parent / "static"
#: a page that stops reading is dropped (it reconnects and re-reads the history) rather than
#: letting its backlog grow without bound in the server
SUBSCRIBER_BACKLOG = 5000
#: commands the console remembers and a page loads at start (the log on disk keeps them all)
COMMAND_HISTORY = 500
#: the lifetime total of storage written, in the station's state (docs/ground.md "Lifetime storage written")
WRITTEN_FILE = "console-written.json"
#: the browser's resumable uploads, in the station's state (docs/ground.md "Upload to the console")
UPLOADS_DIR = "console-uploads"


@dataclass
class ConsoleConfig:
    #: builds a GroundClient with the station's keys; its keyword overrides are GroundOptions
    #: fields (ground.cli._client puts them in with dataclasses.replace)
    client_factory: Callable[..., Any]
    security: ConsoleSecurity = field(default_factory=ConsoleSecurity)
    station: str = ""
    state: Any = None  # ground.state.GroundState
    history: History = field(default_factory=History)
    #: listen to the telemetry link (off in tests that feed the history themselves)
    listen: bool = True


class Hub:
    """Fan-out of records to the pages' event streams."""

    def __init__(self) -> None:
        self.queues: set[asyncio.Queue] = set()

    def publish(self, record: dict) -> None:
        for queue in list(self.queues):
            try:
                queue.put_nowait(record)
            except asyncio.QueueFull:
                self.queues.discard(queue)

    def close(self) -> None:
        """End every page's stream now (the server is shutting down): without this a stream
        holds the shutdown until its next keep-alive, up to 15 s."""
        for queue in list(self.queues):
            self.queues.discard(queue)
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)


def _record(packet: Any) -> dict:
    from ground.report import describe, packet_record

    record = packet_record(packet)
    record["t"] = packet.received_at
    record["sent_t"] = packet.header.time_us / 1e6  # the bus stamped it: bus-to-page latency starts here
    record["text"] = describe(packet.message)
    return record


class Console:
    def __init__(self, config: ConsoleConfig):
        self.config = config
        self.history = config.history
        self.hub = Hub()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop = threading.Event()
        self.commands: deque[dict] = deque(maxlen=COMMAND_HISTORY)
        self.action_lock = asyncio.Lock()
        self.fetched: set[str] = set()
        self.background: set[asyncio.Future] = set()
        self.routine = RoutineFilter()
        self.upload_store: UploadStore | None = None
        if config.state is not None:  # the lifetime storage written, across console restarts
            self.history.restore_written(WrittenStore(Path(config.state.dir) / WRITTEN_FILE))
            # the browser's uploads, resumable across reloads and restarts (docs/ground.md)
            self.upload_store = UploadStore(Path(config.state.dir) / UPLOADS_DIR)

    # --- the telemetry link, in a thread (ZeroMQ receive blocks) -----------------------------
    def ingest(self, record: dict) -> None:
        """Called in the loop's thread: remember, then push to the pages. A routine report the
        CLI's `events` would not print (the bus's once-a-second FDIR "nominal", an unchanged POWER,
        THERMAL: ground/report.py RoutineFilter) is marked `routine`: the events view hides it
        unless asked; the timeline and the plots use every one."""
        if record.get("type") in ROUTINE_TYPES:
            sent = record.get("sent_t") or record.get("t") or 0.0
            record["routine"] = not self.routine.show(str(record["type"]), record.get("body") or {}, float(sent))
        pushed = self.history.add(record)
        self.hub.publish(pushed or record)
        self._say_notes()
        body = record.get("body") or {}
        if record.get("type") == "EVENT" and body.get("event_id") == "TASK_COMPLETED" and body.get("task_id"):
            self._fetch_result(str(body["task_id"]))

    def _say_notes(self) -> None:
        """What the history has to tell the operator (a damaged or unwritable saved total), as a
        CONSOLE event on the events view."""
        while self.history.notes:
            self.ingest({"t": time.time(), "type": "CONSOLE", "text": self.history.notes.pop(0)})

    def _fetch_result(self, task: str) -> None:
        """A task of this station completed: downlink its result, as `ow ground results TASK`
        would, so the task view shows the answer and its verification without being asked."""
        state = self.config.state
        if self.config.security.read_only or state is None or task in self.fetched:
            return
        if state.load_result(task) is not None or state.task(task) is None:
            return  # already here, or another station's task
        self.fetched.add(task)
        future = asyncio.ensure_future(self._act(lambda c: c.result(task)))
        self.background.add(future)  # held until done: the loop keeps only weak references
        future.add_done_callback(self.background.discard)

    def _listen(self) -> None:
        while not self.stop.is_set():
            try:
                with self.config.client_factory(commands=False, notify=lambda text: None) as client:
                    for packet in client.telemetry(None):
                        if self.stop.is_set():
                            return
                        record = _record(packet)
                        assert self.loop is not None
                        self.loop.call_soon_threadsafe(self.ingest, record)
            except Exception as exc:  # the link failing must not end the console: say so, retry
                if self.loop is not None:
                    note = {"t": time.time(), "type": "CONSOLE", "text": f"telemetry link: {exc}"}
                    self.loop.call_soon_threadsafe(self.ingest, note)
                self.stop.wait(2.0)

    async def on_startup(self, app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        self._say_notes()
        if self.upload_store is not None:
            removed = await asyncio.to_thread(self.upload_store.sweep)
            if removed:
                text = f"removed {len(removed)} unfinished upload(s) untouched for 7 days from {self.upload_store.root}"
                self.ingest({"t": time.time(), "type": "CONSOLE", "text": text})
        if self.config.listen:
            threading.Thread(target=self._listen, name="console-telemetry", daemon=True).start()
        if self.config.state is not None:
            threading.Thread(target=self._follow_commands, name="console-commands", daemon=True).start()

    async def on_shutdown(self, app: web.Application) -> None:
        self.hub.close()

    async def on_cleanup(self, app: web.Application) -> None:
        self.stop.set()

    # --- security ------------------------------------------------------------------------------
    @web.middleware
    async def guard(self, request: web.Request, handler):
        security = self.config.security
        if request.method not in ("GET", "HEAD"):
            if security.read_only:
                return _error(403, "this console is read-only: it serves views only")
            if not security.token_ok(request.headers.get(TOKEN_HEADER)):
                return _error(401, f"missing or wrong console token (header {TOKEN_HEADER})")
            origin = request.headers.get("Origin")
            own = f"{request.scheme}://{request.host}"
            if origin != own:
                return _error(403, f"cross-origin request refused (Origin {origin or 'missing'}, console {own})")
        response = await handler(request)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "no-referrer")
        response.headers.setdefault(
            "Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"
        )
        return response

    # --- views ---------------------------------------------------------------------------------
    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def info(self, request: web.Request) -> web.Response:
        t0, t1 = self.history.span()
        return web.json_response(
            {
                "read_only": self.config.security.read_only,
                "token_required": bool(self.config.security.token),
                "station": self.config.station,
                "series": sorted(SERIES_NAMES),
                "span": [t0, t1],
                "events": self.history.number,
            }
        )

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        queue: asyncio.Queue = asyncio.Queue(maxsize=SUBSCRIBER_BACKLOG)
        self.hub.queues.add(queue)
        try:
            await response.write(b": connected\n\n")
            while queue in self.hub.queues:
                try:
                    record = await asyncio.wait_for(queue.get(), timeout=15.0)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")  # proxies close silent streams
                    continue
                if record is None:
                    break  # the console is shutting down (Hub.close)
                record = dict(record, pushed=time.time())
                await response.write(f"data: {json.dumps(record, default=str)}\n\n".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.hub.queues.discard(queue)
        return response

    async def events(self, request: web.Request) -> web.Response:
        after = _int(request, "after", 0)
        limit = min(_int(request, "limit", 500), 5000)
        kinds = {k for k in request.query.get("kind", "").split(",") if k} or None
        return web.json_response(
            {"events": self.history.events_page(after, limit, kinds), "commands": list(self.commands)},
            dumps=_dumps,
        )

    def _range(self, request: web.Request) -> tuple[float, float]:
        s0, s1 = self.history.span()
        return _float(request, "t0", s0), _float(request, "t1", s1)

    async def timeline(self, request: web.Request) -> web.Response:
        t0, t1 = self._range(request)
        span = list(self.history.span())  # the whole history: how far the page may pan
        return web.json_response(dict(self.history.timeline(t0, t1), t0=t0, t1=t1, span=span), dumps=_dumps)

    async def telemetry(self, request: web.Request) -> web.Response:
        t0, t1 = self._range(request)
        buckets = max(10, min(_int(request, "buckets", 800), 4000))
        names = [n for n in request.query.get("series", "").split(",") if n] or None
        return web.json_response(
            {"t0": t0, "t1": t1, "series": self.history.telemetry(t0, t1, buckets, names)}, dumps=_dumps
        )

    async def telemetry_csv(self, request: web.Request) -> web.Response:
        t0, t1 = self._range(request)
        names = [n for n in request.query.get("series", "").split(",") if n] or sorted(SERIES_NAMES)
        unknown = [n for n in names if n not in SERIES_NAMES]
        if unknown:
            return _error(400, f"unknown series: {', '.join(unknown)}")
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["time_unix_s", "series", "value"])
        for name, (ts, vs) in self.history.raw(t0, t1, names).items():
            for t, v in zip(ts, vs, strict=True):
                writer.writerow([repr(t), name, repr(v)])
        return web.Response(
            text=out.getvalue(),
            content_type="text/csv",
            headers={"Content-Disposition": f'attachment; filename="telemetry-{t0:.0f}-{t1:.0f}.csv"'},
        )

    async def tasks(self, request: web.Request) -> web.Response:
        state = self.config.state
        tasks = state.tasks() if state is not None and state.tasks_path.exists() else []
        with self.history.lock:
            cuts = list(self.history.cuts)
            hk = (self.history.latest.get("HOUSEKEEPING") or {}).get("body") or {}
            progress = {task: dict(entry) for task, entry in self.history.progress.items()}
        for task in tasks:
            result = state.load_result(task["task_id"])
            if result is not None:
                task["result"] = result
            # what the console saw of it: the cuts it was running through, its progress now
            task["cuts_seen"] = sum(1 for cut in cuts if cut.get("task") == task["task_id"])
            # its latest progress (its PROGRESS reports, the payload's HOUSEKEEPING), the
            # checkpoint bytes while it is the payload's current task
            latest = progress.get(task["task_id"])
            if latest is not None:
                task["live"] = {k: latest[k] for k in ("phase", "done", "total")}
                if hk.get("current_task") == task["task_id"]:
                    task["live"]["checkpoint_bytes"] = hk.get("checkpoint_bytes")
        return web.json_response({"tasks": tasks, "forecast": self._forecast(tasks)}, dumps=_dumps)

    def _forecast(self, tasks: list[dict]) -> Any:
        """The completion forecast (ground/forecast.py, as `ow ground status` prints it) from the
        station's forecast basis (the payload's profile and window history, kept by its ground
        state as the telemetry arrives); None without a ground state. Any failure of the forecast
        must not take the task view with it."""
        state = self.config.state
        if state is None:
            return None
        try:
            return forecast_tasks(state.tasks(), state.forecast_basis())
        except Exception as exc:  # noqa: BLE001 - the task view stays up and says what failed
            return {"error": f"forecast failed: {exc}"}

    # --- actions -------------------------------------------------------------------------------
    async def _act(self, work: Callable[[Any], Any], **client_options: Any) -> web.Response:
        """Run one command through a fresh GroundClient in a worker thread. The client logs what
        it sends in the station's command log, whence the command history shows it, as it shows
        the CLI's (`_follow_commands`)."""
        async with self.action_lock:
            try:
                result = await asyncio.to_thread(self._run_client, work, client_options)
            except GroundError as exc:
                return _error(400 if isinstance(exc, LocalInputError) else 502, str(exc))
        return web.json_response({"ok": True, "result": result}, dumps=_dumps)

    def _run_client(self, work: Callable[[Any], Any], options: dict) -> Any:
        from ground.report import to_jsonable

        with self.config.client_factory(notify=lambda text: None, progress=False, **options) as client:
            return to_jsonable(work(client))

    def _upload_progress(self) -> Callable[[str, int, int], None]:
        """An uplink's progress to the payload, pushed to the pages as UPLOAD records (image,
        bytes on board, size): called in the client's thread as chunks are acknowledged; at most
        five a second per image, and always the first and the last."""
        loop = self.loop
        assert loop is not None
        last: dict[str, float] = {}

        def report(name: str, done: int, size: int) -> None:
            now = time.monotonic()
            if done < size and now - last.get(name, -1.0) < 0.2:
                return
            last[name] = now
            record = {"type": "UPLOAD", "t": time.time(), "image": name, "done": done, "size": size}
            loop.call_soon_threadsafe(self.hub.publish, record)

        return report

    # --- the command history: the station's shared command log -------------------------------
    def _log(self, entry: dict) -> None:
        entry = dict(entry, type="COMMAND")
        self.commands.append(entry)
        self.hub.publish(entry)

    def _follow_commands(self) -> None:
        """Follow the station's command log (ground/state.py `commands.jsonl`), which every
        `ow ground` process of this station writes, this console's own client included: what it
        holds at start (the rotated file first) is remembered, each line appended later is also
        pushed to the pages. New lines are looked for twice a second; a rotation is followed to
        the new file once the old one is read to its end (command_log.CommandLogReader)."""
        state = self.config.state
        assert state is not None and self.loop is not None
        loop = self.loop
        reader = CommandLogReader(state.command_log_path)
        try:
            loop.call_soon_threadsafe(self._remember_commands, reader.backlog()[-COMMAND_HISTORY:])
            while not self.stop.wait(0.5):
                for entry in reader.new():
                    loop.call_soon_threadsafe(self._log, entry)
        finally:
            reader.close()

    def _remember_commands(self, entries: list[dict]) -> None:
        self.commands.extend(dict(entry, type="COMMAND") for entry in entries)

    async def cancel(self, request: web.Request) -> web.Response:
        task = _task_id(request)
        return await self._act(lambda c: c.cancel(task))

    async def priority(self, request: web.Request) -> web.Response:
        from ground.images import check_priority

        task = _task_id(request)
        form = await request.post()
        try:
            priority = check_priority(int(str(form.get("priority", ""))))
        except ValueError:
            return _error(400, "priority must be a whole number")
        except LocalInputError as exc:
            return _error(400, str(exc))
        return await self._act(lambda c: c.set_priority(task, priority))

    async def resend(self, request: web.Request) -> web.Response:
        task = _task_id(request)
        return await self._act(lambda c: c.resend(task).to_dict())

    async def release(self, request: web.Request) -> web.Response:
        item = request.match_info["item"]
        return await self._act(lambda c: c.release(item))

    # --- uploads from the browser: resumable, in chunks (uploads.py) ---------------------------
    def _uploads(self) -> UploadStore:
        if self.upload_store is None:
            raise web.HTTPServiceUnavailable(text="this console has no station state to keep uploads in")
        return self.upload_store

    async def upload_create(self, request: web.Request) -> web.Response:
        """POST /api/uploads {"name", "size", "sha256"}: make the upload or say where it stands."""
        store = self._uploads()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "not a JSON upload request")
        if not isinstance(body, dict):
            return _error(400, "not a JSON upload request")
        try:
            answer = await asyncio.to_thread(store.create, body.get("name"), body.get("size"), body.get("sha256"))
        except UploadError as exc:
            return _upload_error(exc)
        except OSError as exc:
            return _error(507, f"the console cannot store the upload: {exc.strerror or exc}")
        return web.json_response(answer)

    async def upload_chunk(self, request: web.Request) -> web.Response:
        """PUT /api/uploads/<sha256> with Upload-Offset and Chunk-SHA256: one chunk, kept only
        whole and with the hash announced, durable before it is answered."""
        store = self._uploads()
        upload = request.match_info["upload"]
        try:
            offset = int(request.headers.get("Upload-Offset", ""))
        except ValueError:
            return _error(400, "Upload-Offset must be a whole number of bytes")
        chunk_sha256 = request.headers.get("Chunk-SHA256", "").strip().lower()
        if not chunk_sha256:
            return _error(400, "Chunk-SHA256 (the chunk's SHA-256, hex) is missing")
        if request.content_length is not None and request.content_length > MAX_CHUNK_BYTES:
            return _error(413, f"a chunk of {request.content_length} bytes: at most {MAX_CHUNK_BYTES}")
        try:
            data = await request.read()
        except (ConnectionError, asyncio.IncompleteReadError, ClientPayloadError, web.HTTPException):
            return _error(400, "the chunk was cut off before its end: nothing kept")
        if request.content_length is not None and len(data) != request.content_length:
            return _error(400, "the chunk was cut off before its end: nothing kept")
        try:
            answer = await asyncio.to_thread(store.write, upload, offset, data, chunk_sha256)
        except UploadError as exc:
            return _upload_error(exc)
        except OSError as exc:
            return _error(507, f"the console cannot store the chunk: {exc.strerror or exc}")
        return web.json_response(answer)

    # --- the uplink ---------------------------------------------------------------------------
    async def uplink(self, request: web.Request) -> web.Response:
        """The same checks, in the same order and with the same messages, as `ow ground uplink`:
        the prompt, max new tokens, priority, then the images. JSON names uploads the page sent
        in chunks; the multipart form carries the images whole."""
        if request.content_type == "application/json":
            return await self._uplink_uploaded(request)
        return await self._uplink_form(request)

    @staticmethod
    def _check_fields(fields: dict) -> tuple[str, int, dict]:
        """(prompt, priority, uplink options); LocalInputError or ValueError as the CLI's checks."""
        from ground.images import check_max_new_tokens, check_priority, check_prompt

        prompt = fields.get("prompt", "")
        if not isinstance(prompt, str):
            raise LocalInputError("prompt must be text")
        prompt = check_prompt(prompt)
        max_new_tokens = _whole(fields.get("max_new_tokens") or 0) or None
        priority = _whole(fields.get("priority") or 0)
        if max_new_tokens is not None:
            check_max_new_tokens(max_new_tokens)
        check_priority(priority)
        return prompt, priority, ({} if max_new_tokens is None else {"max_new_tokens": max_new_tokens})

    async def _uplink_uploaded(self, request: web.Request) -> web.Response:
        from ground.images import prepare_images

        store = self._uploads()
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "not a JSON uplink request")
        if isinstance(body, dict) and body.get("check_only") is True:
            # the page asks this before it sends any image: a bad prompt or number is refused
            # first, as the CLI refuses it before it reads the files
            try:
                self._check_fields(body)
            except LocalInputError as exc:
                return _error(400, str(exc))
            except (ValueError, TypeError):
                return _error(400, "max new tokens and priority must be whole numbers")
            return web.json_response({"ok": True, "checked": True})
        images = body.get("images") if isinstance(body, dict) else None
        if not isinstance(images, list) or not all(isinstance(i, dict) for i in images):
            return _error(400, 'not an uplink request: "images" must be a list of {"upload", "name"}')
        names: dict[str, str] = {}
        try:
            prompt, priority, options = self._check_fields(body)
            paths = []
            for image in images:
                path = await asyncio.to_thread(store.path, image.get("upload"), image.get("name"))
                names[path] = str(image.get("name"))
                paths.append(path)
            await asyncio.to_thread(prepare_images, paths)
        except LocalInputError as exc:
            return _error(400, _as_operator_sees(str(exc), names))
        except UploadError as exc:
            return _upload_error(exc)
        except (ValueError, TypeError):
            return _error(400, "max new tokens and priority must be whole numbers")
        return await self._send_uplink(paths, names, prompt, priority, options)

    async def _uplink_form(self, request: web.Request) -> web.Response:
        from ground.images import prepare_images

        reader = await request.multipart()
        fields: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="ow-console-") as tmp:
            paths: list[str] = []
            async for part in reader:
                if not isinstance(part, BodyPartReader):
                    return _error(400, "nested multipart is not an uplink form")
                if part.name == "image" and part.filename:
                    name = Path(part.filename).name or "image"
                    folder = Path(tmp) / str(len(paths))
                    folder.mkdir()
                    path = folder / name
                    with path.open("wb") as out:
                        while chunk := await part.read_chunk():
                            out.write(chunk)
                    paths.append(str(path))
                elif part.name:
                    fields[part.name] = (await part.text())[:100_000]
            names = {p: Path(p).name for p in paths}
            try:
                prompt, priority, options = self._check_fields(fields)
                await asyncio.to_thread(prepare_images, paths)
            except LocalInputError as exc:
                return _error(400, _as_operator_sees(str(exc), names))
            except ValueError:
                return _error(400, "max new tokens and priority must be whole numbers")
            if self.upload_store is not None:  # kept where `resend` finds them later
                stored = [await asyncio.to_thread(self.upload_store.adopt, p, names[p]) for p in paths]
                names.update({s: names[p] for s, p in zip(stored, paths, strict=True)})
                paths = stored
            return await self._send_uplink(paths, names, prompt, priority, options)

    async def _send_uplink(
        self, paths: list[str], names: dict[str, str], prompt: str, priority: int, options: dict
    ) -> web.Response:
        response = await self._act(
            lambda c: c.uplink(paths, prompt, priority=priority, **options).to_dict(),
            upload_progress=self._upload_progress(),
        )
        if response.status != 200:
            assert isinstance(response.text, str)
            response.text = _as_operator_sees(response.text, names)
        return response


def _as_operator_sees(text: str, names: dict[str, str]) -> str:
    """A message about a file in the console's store, naming it as the operator named it."""
    for path, name in names.items():
        text = text.replace(repr(path), repr(name))
    return text


def _whole(value: object) -> int:
    """A whole number from the form (text) or from JSON (a number): 8 or "8", never 8.5 or true."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    raise ValueError(f"not a whole number: {value!r}")


def _upload_error(exc: UploadError) -> web.Response:
    body: dict[str, Any] = {"ok": False, "error": exc.message}
    if exc.offset is not None:
        body["offset"] = exc.offset
    return web.json_response(body, status=exc.status)


def _dumps(data: Any) -> str:
    return json.dumps(data, default=str)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"ok": False, "error": message}, status=status)


def _int(request: web.Request, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a whole number") from None


def _float(request: web.Request, name: str, default: float) -> float:
    try:
        value = float(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=f"{name} must be a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise web.HTTPBadRequest(text=f"{name} must be finite")
    return value


def _task_id(request: web.Request) -> str:
    from ground.images import check_operator_name

    try:
        return check_operator_name(request.match_info["task"], "task id")
    except LocalInputError as exc:
        raise web.HTTPBadRequest(text=str(exc)) from None


CONSOLE_KEY = web.AppKey("console", Console)


def make_app(config: ConsoleConfig) -> web.Application:
    console = Console(config)
    app = web.Application(middlewares=[console.guard], client_max_size=64 * 1024 * 1024)
    app[CONSOLE_KEY] = console
    app.on_startup.append(console.on_startup)
    app.on_shutdown.append(console.on_shutdown)
    app.on_cleanup.append(console.on_cleanup)
    app.router.add_get("/", console.index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/info", console.info)
    app.router.add_get("/api/stream", console.stream)
    app.router.add_get("/api/events", console.events)
    app.router.add_get("/api/timeline", console.timeline)
    app.router.add_get("/api/telemetry", console.telemetry)
    app.router.add_get("/api/telemetry.csv", console.telemetry_csv)
    app.router.add_get("/api/tasks", console.tasks)
    app.router.add_post("/api/uploads", console.upload_create)
    app.router.add_put("/api/uploads/{upload}", console.upload_chunk)
    app.router.add_post("/api/uplink", console.uplink)
    app.router.add_post("/api/tasks/{task}/cancel", console.cancel)
    app.router.add_post("/api/tasks/{task}/priority", console.priority)
    app.router.add_post("/api/tasks/{task}/resend", console.resend)
    app.router.add_post("/api/quarantine/{item}/release", console.release)
    return app


def run(
    config: ConsoleConfig, port: int, *, announce: Callable[[str], None] = print, token_in_url: bool = False
) -> None:
    """Serve until Ctrl-C (or SIGTERM); refuses first what security.check_startup refuses.
    Announces the address once it is bound, with the port the system gave (`port` 0: any free
    one). `token_in_url`: the token was made for this run, so the address announced carries it
    (`#token=`, read by the page and never sent to the server) for the operator to open."""
    security = config.security
    security.check_startup()
    scheme = "https" if security.tls_cert else "http"
    fragment = f"#token={security.token}" if token_in_url and security.token else ""

    async def serve() -> None:
        runner = web.AppRunner(make_app(config), access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, security.host, port, ssl_context=security.ssl_context())
            await site.start()
            bound = runner.addresses[0][1]  # what the system gave for port 0
            announce(
                f"console on {scheme}://{security.host}:{bound}/{fragment}"
                + (" (read-only)" if security.read_only else "")
            )
            stop = asyncio.Event()
            with contextlib.suppress(NotImplementedError):  # (no signal handlers off the main thread)
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


class ConsoleThread(threading.Thread):
    """The console on a loopback port in its own thread and event loop, for programs that drive
    it in-process (the browser tests, bench/console_bench.py). `port` is set once `ready` is."""

    def __init__(self, config: ConsoleConfig, host: str = "127.0.0.1", port: int = 0):
        super().__init__(name="console", daemon=True)
        self.config, self.host, self.port = config, host, port
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.app = make_app(config)

    @property
    def console(self) -> Console:
        return self.app[CONSOLE_KEY]

    def run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port)
        self.loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.join(timeout=10)
