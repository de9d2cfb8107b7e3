"""The robot-facing policy endpoint: the openpi websocket policy protocol.

Protocol (as openpi's `WebsocketPolicyServer` and vLLM-Omni's robot endpoint speak it, so a
robot using `openpi_client.websocket_client_policy.WebsocketClientPolicy` connects unchanged):
  * on connect the server sends its metadata (a msgpack map);
  * each binary message is one msgpack-numpy observation; the reply is a msgpack map with
    `actions` (horizon x action_dim float32) and `server_timing` (milliseconds);
  * an error is answered with a *text* frame (openpi's client raises it as RuntimeError); this
    server then keeps the connection open, so a robot can send a corrected request, and the
    other robots are unaffected.
The model is chosen by the URL path (`ws://HOST:PORT/<model>`); `/` is the default model.
`GET /healthz` answers 200 like openpi's server.

Robots are known by key: with keys configured, a connection must carry openpi-client's
`Authorization: Api-Key <key>` header (`WebsocketClientPolicy(api_key=...)`), else the upgrade
is refused with HTTP 401 and a reason. Without keys the endpoint binds loopback addresses only.

One `ServingEngine` per GPU of the controller's plan; a robot is routed, for its whole
connection, to the GPU with the most unused robot places for its model (`Router`). The
flow-matching noise of a request is seeded from the request's bytes, so an observation gets the
same action chunk whichever GPU, batch or server serves it.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import ipaddress
import socket
import threading
import time
import zlib
from dataclasses import dataclass

import websockets
from websockets.asyncio.server import ServerConnection, serve

from common import log as ow_log
from common.vla.config import model_spec
from common.vla.engine import ServingEngine
from common.vla.wire import (
    IMAGE_KEYS,
    PROMPT_KEY,
    STATE_KEY,
    RequestError,
    ServerTiming,
    packb,
    parse_observation,
    unpackb,
)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # a LIBERO observation is ~0.3 MB


def is_loopback(host: str) -> bool:
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc}") from None
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def require_loopback(host: str) -> str:
    """Without robot keys the endpoint never listens beyond this machine."""
    if not is_loopback(host):
        raise ValueError(
            f"refusing to listen on {host!r} without robot keys: pass --token or --keys to serve "
            "beyond loopback addresses"
        )
    return host


def load_keys(path: str) -> dict[str, str]:
    """A key file: one robot per line, `NAME KEY` (or just `KEY`); `#` starts a comment."""
    keys: dict[str, str] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            parts = line.split("#", 1)[0].split()
            if not parts:
                continue
            if len(parts) > 2:
                raise ValueError(f"{path}:{number}: expected 'NAME KEY' or 'KEY'")
            name, key = (parts[0], parts[1]) if len(parts) == 2 else (f"robot-{number}", parts[0])
            if len(key) < 16:
                raise ValueError(f"{path}:{number}: key of {name!r} is shorter than 16 characters")
            if key in keys:
                raise ValueError(f"{path}:{number}: key of {name!r} repeats the key of {keys[key]!r}")
            keys[key] = name
    if not keys:
        raise ValueError(f"{path}: no keys")
    return keys


def robot_for_key(keys: dict[str, str] | None, header: str | None) -> tuple[str | None, str | None]:
    """(robot name, None) for a known key, (None, reason) otherwise; (None, None) when no keys are set."""
    if keys is None:
        return None, None
    scheme, _, key = (header or "").partition(" ")
    if scheme != "Api-Key" or not key:
        return None, "this endpoint serves known robots only: send 'Authorization: Api-Key <key>'"
    for known, name in keys.items():  # compare every key in constant time: no timing hints
        if hmac.compare_digest(known.encode(), key.strip().encode()):
            return name, None
    return None, "unknown robot key"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    default_model: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    keys: dict[str, str] | None = None  # key -> robot name; None: no authentication (loopback only)


class Router:
    """Which GPU serves a new robot of a model: the one with the most unused places in the plan;
    past the plan, the least overfilled one (and the server logs it). `hosted[i]` are the models
    GPU i serves, `quotas[i]` its robots per model (None: unlimited)."""

    def __init__(self, hosted: list, quotas: list[dict[str, int]] | None = None):
        self.hosted = [set(h) for h in hosted]
        self.quotas = quotas or [{m: 1 << 30 for m in h} for h in self.hosted]
        self.connected = [dict.fromkeys(h, 0) for h in self.hosted]

    def models(self) -> list[str]:
        return sorted(set().union(*self.hosted))

    def acquire(self, model: str) -> tuple[int, bool]:
        """(GPU index, within the plan)"""
        hosts = [i for i, h in enumerate(self.hosted) if model in h]
        i = max(
            hosts,
            key=lambda i: (
                self.quotas[i].get(model, 0) - self.connected[i][model],
                -self.connected[i][model] / max(1, self.quotas[i].get(model, 0)),
            ),
        )
        within = self.connected[i][model] < self.quotas[i].get(model, 0)
        self.connected[i][model] += 1
        return i, within

    def release(self, i: int, model: str) -> None:
        self.connected[i][model] -= 1


def noise_seed(message: bytes) -> int:
    """The request's flow-matching noise seed: from its bytes, so the answer is where-independent."""
    return zlib.crc32(message)


async def answer(
    engine: ServingEngine,
    model: str,
    message,
    robot: str,
    max_request_bytes: int,
    prev_total_ms: float | None = None,
    extra: dict | None = None,
) -> tuple[bytes | str, bool]:
    """One request through `engine`: (the reply frame, served). A str reply is an error for the robot."""
    t0 = time.monotonic()
    if isinstance(message, str):
        return "error: expected a binary msgpack observation, got a text frame", False
    if len(message) > max_request_bytes:
        return f"error: request of {len(message)} bytes exceeds the limit of {max_request_bytes} bytes", False
    loop = asyncio.get_running_loop()
    try:
        obs = parse_observation(unpackb(message), noise_seed=noise_seed(message))
        inputs = await loop.run_in_executor(None, engine.policies[model].prepare, obs)
    except (RequestError, ValueError) as exc:
        return f"error: {exc}", False
    try:
        result = await asyncio.wrap_future(engine.submit(model, inputs, robot=robot))
    except Exception as exc:
        return f"error: inference failed: {exc}", False
    infer_ms = (time.monotonic() - t0) * 1e3
    timing = ServerTiming(infer_ms, result.vlm_done_ms, result.total_ms, prev_total_ms)
    reply = {
        "actions": result.actions,
        "model": model,
        "slo_met": bool(result.slo_met),
        "server_timing": timing.to_wire(),
        "policy_timing": {"infer_ms": result.total_ms},
    }
    return packb({**reply, **(extra or {})}), True


def metadata(engine: ServingEngine, model: str, max_request_bytes: int, extra: dict | None = None) -> dict:
    cfg = model_spec(model).arch_config
    return {
        "server": "orbitweaver-vla",
        "model": model,
        "action_horizon": cfg.action_horizon,
        "action_dim": cfg.output_action_dim,
        "image_size": cfg.image_size,
        "observation_keys": [*IMAGE_KEYS, STATE_KEY, PROMPT_KEY],
        "slo_ms": engine.slo_ms[model],
        "scheduler": type(engine.scheduler).__name__,
        "queue_policy": engine.scheduler.policy_name,
        "max_request_bytes": max_request_bytes,
        **(extra or {}),
    }


class PolicyServer:
    def __init__(
        self,
        engines: ServingEngine | list[ServingEngine],
        config: ServerConfig = ServerConfig(),
        quotas: list[dict[str, int]] | None = None,
    ):
        if config.keys is None:
            require_loopback(config.host)
        engines = [engines] if isinstance(engines, ServingEngine) else list(engines)
        self.router = Router([e.policies for e in engines], quotas)
        self.engines, self.config = engines, config
        self.engine = engines[0]
        self.default_model = config.default_model or next(iter(self.engine.policies))
        if self.default_model not in self.router.models():
            raise ValueError(f"default model {self.default_model!r} is not loaded")
        self.port: int | None = None
        self.rejected = 0
        self.refused = 0  # connections without a known key
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._log = ow_log.get("vla.server")

    # ---- lifecycle (the server runs its own event loop thread) ----
    def start(self, timeout: float = 30.0) -> PolicyServer:
        self._thread = threading.Thread(target=self._thread_main, name="vla-policy-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("policy server did not start")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def url(self) -> str:
        host = self.config.host
        return f"ws://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def _thread_main(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # e.g. the port is taken: reported by start()
            self._error = exc
            self._ready.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        limit = self.config.max_request_bytes
        # The transport limit is above the request limit so that an oversized request still gets a
        # readable error reply; far larger frames are cut off by the transport (close code 1009).
        async with serve(
            self._handler,
            self.config.host,
            self.config.port,
            compression=None,
            max_size=max(4 * limit, limit + (1 << 20)),
            process_request=self._gate,
        ) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._log.info(
                "vla_server_listening",
                url=self.url,
                models=self.router.models(),
                gpus=len(self.engines),
                authenticated=self.config.keys is not None,
            )
            self._ready.set()
            await self._stop.wait()

    def _gate(self, connection: ServerConnection, request):
        """Health checks pass; everything else needs a known robot key when keys are set."""
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        name, reason = robot_for_key(self.config.keys, request.headers.get("Authorization"))
        if reason is not None:
            self.refused += 1
            self._log.warning("vla_robot_refused", peer=str(connection.remote_address[0]), reason=reason)
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, f"{reason}\n")
        connection.robot_name = name  # type: ignore[attr-defined]  # per-connection data, read by _handler
        return None

    # ---- one robot ----
    def metadata(self, model: str) -> dict:
        return metadata(self.engine_for(model), model, self.config.max_request_bytes, {"models": self.router.models()})

    def engine_for(self, model: str) -> ServingEngine:
        return next(e for e in self.engines if model in e.policies)

    def _model_for(self, path: str) -> str | None:
        name = path.split("?", 1)[0].strip("/")
        name = name.removeprefix("models/")
        if not name:
            return self.default_model
        return name if name in self.router.models() else None

    async def _handler(self, ws: ServerConnection) -> None:
        host, port = ws.remote_address[:2]
        peer = f"{host}:{port}"
        robot = getattr(ws, "robot_name", None) or peer
        assert ws.request is not None  # handlers run after the opening handshake
        model = self._model_for(ws.request.path)
        if model is None:
            await ws.send(f"error: unknown model path {ws.request.path!r}; serving {', '.join(self.router.models())}")
            await ws.close(code=1008, reason="unknown model")
            return
        gpu, within = self.router.acquire(model)
        engine = self.engines[gpu]
        log = self._log.bind(robot=robot, model=model, gpu=gpu)
        log.info("vla_robot_connected", peer=peer, within_plan=within)
        if not within:
            log.warning("vla_robot_beyond_plan")
        prev_total_ms = None
        try:
            await ws.send(
                packb(
                    metadata(engine, model, self.config.max_request_bytes, {"models": self.router.models(), "gpu": gpu})
                )
            )
            async for message in ws:
                t0 = time.monotonic()
                reply, served = await answer(
                    engine, model, message, robot, self.config.max_request_bytes, prev_total_ms, {"gpu": gpu}
                )
                if not served:
                    self.rejected += 1
                    log.warning("vla_request_rejected", reason=reply)
                await ws.send(reply)
                if served:
                    prev_total_ms = (time.monotonic() - t0) * 1e3
        except websockets.ConnectionClosed:
            pass
        finally:
            self.router.release(gpu, model)
            log.info("vla_robot_disconnected", code=ws.close_code)
