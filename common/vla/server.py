"""The robot-facing policy endpoint: the openpi websocket policy protocol on loopback.

Protocol (as openpi's `WebsocketPolicyServer` and vLLM-Omni's robot endpoint speak it, so a
robot using `openpi_client.websocket_client_policy.WebsocketClientPolicy` connects unchanged):
  * on connect the server sends its metadata (a msgpack map);
  * each binary message is one msgpack-numpy observation; the reply is a msgpack map with
    `actions` (horizon x action_dim float32) and `server_timing` (milliseconds);
  * an error is answered with a *text* frame (openpi's client raises it as RuntimeError); this
    server then keeps the connection open, so a robot can send a corrected request, and the
    other robots are unaffected.
The model is chosen by the URL path (`ws://127.0.0.1:PORT/<model>`); `/` is the default model.
`GET /healthz` answers 200 like openpi's server. Requests go through the same `ServingEngine`
(and so the same scheduler) as everything else.
"""
from __future__ import annotations

import asyncio
import http
import ipaddress
import itertools
import socket
import threading
import time
from dataclasses import dataclass

import websockets
from websockets.asyncio.server import ServerConnection, serve

from common import log as ow_log
from common.vla.engine import ServingEngine
from common.vla.wire import IMAGE_KEYS, PROMPT_KEY, STATE_KEY, RequestError, ServerTiming, packb, parse_observation, unpackb

DEFAULT_MAX_REQUEST_BYTES = 1 << 20  # a LIBERO observation is ~0.3 MB


def require_loopback(host: str) -> str:
    """The endpoint never listens beyond this machine."""
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve host {host!r}: {exc}") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"refusing to listen on {host!r}: the policy endpoint binds loopback addresses only")
    return host


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    default_model: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class PolicyServer:
    def __init__(self, engine: ServingEngine, config: ServerConfig = ServerConfig()):
        require_loopback(config.host)
        self.engine, self.config = engine, config
        self.default_model = config.default_model or next(iter(engine.policies))
        if self.default_model not in engine.policies:
            raise ValueError(f"default model {self.default_model!r} is not loaded")
        self.port: int | None = None
        self.rejected = 0
        self._seeds = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._log = ow_log.get("vla.server")

    # ---- lifecycle (the server runs its own event loop thread) ----
    def start(self, timeout: float = 30.0) -> "PolicyServer":
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
        return f"ws://{self.config.host}:{self.port}"

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
        async with serve(self._handler, self.config.host, self.config.port, compression=None,
                         max_size=max(4 * limit, limit + (1 << 20)), process_request=self._health) as server:
            self.port = server.sockets[0].getsockname()[1]
            self._log.info("vla_server_listening", url=self.url, models=sorted(self.engine.policies))
            self._ready.set()
            await self._stop.wait()

    @staticmethod
    def _health(connection: ServerConnection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        return None

    # ---- one robot ----
    def metadata(self, model: str) -> dict:
        policy = self.engine.policies[model]
        return {
            "server": "orbitweaver-vla",
            "model": model,
            "models": sorted(self.engine.policies),
            "action_horizon": policy.cfg.action_horizon,
            "action_dim": policy.cfg.output_action_dim,
            "image_size": policy.cfg.image_size,
            "observation_keys": [*IMAGE_KEYS, STATE_KEY, PROMPT_KEY],
            "slo_ms": self.engine.slo_ms[model],
            "scheduler": type(self.engine.scheduler).__name__,
            "queue_policy": self.engine.scheduler.policy_name,
            "max_request_bytes": self.config.max_request_bytes,
        }

    def _model_for(self, path: str) -> str | None:
        name = path.split("?", 1)[0].strip("/")
        name = name.removeprefix("models/")
        if not name:
            return self.default_model
        return name if name in self.engine.policies else None

    async def _reject(self, ws: ServerConnection, robot: str, reason: str) -> None:
        self.rejected += 1
        self._log.warning("vla_request_rejected", robot=robot, reason=reason)
        await ws.send(f"error: {reason}")

    async def _handler(self, ws: ServerConnection) -> None:
        robot = "%s:%s" % tuple(ws.remote_address[:2])
        model = self._model_for(ws.request.path)
        if model is None:
            await ws.send(f"error: unknown model path {ws.request.path!r}; serving {', '.join(sorted(self.engine.policies))}")
            await ws.close(code=1008, reason="unknown model")
            return
        log = self._log.bind(robot=robot, model=model)
        log.info("vla_robot_connected")
        await ws.send(packb(self.metadata(model)))
        policy = self.engine.policies[model]
        prev_total_ms = None
        loop = asyncio.get_running_loop()
        try:
            async for message in ws:
                t0 = time.monotonic()
                if isinstance(message, str):
                    await self._reject(ws, robot, "expected a binary msgpack observation, got a text frame")
                    continue
                if len(message) > self.config.max_request_bytes:
                    await self._reject(ws, robot, f"request of {len(message)} bytes exceeds the limit of "
                                                  f"{self.config.max_request_bytes} bytes")
                    continue
                try:
                    obs = parse_observation(unpackb(message), noise_seed=next(self._seeds))
                    inputs = await loop.run_in_executor(None, policy.prepare, obs)
                except (RequestError, ValueError) as exc:
                    await self._reject(ws, robot, str(exc))
                    continue
                try:
                    result = await asyncio.wrap_future(self.engine.submit(model, inputs, robot=robot))
                except Exception as exc:
                    log.error("vla_inference_failed", error=repr(exc))
                    await ws.send(f"error: inference failed: {exc}")
                    continue
                infer_ms = (time.monotonic() - t0) * 1e3
                timing = ServerTiming(infer_ms, result.vlm_done_ms, result.total_ms, prev_total_ms)
                await ws.send(packb({
                    "actions": result.actions,
                    "model": model,
                    "slo_met": bool(result.slo_met),
                    "server_timing": timing.to_wire(),
                    "policy_timing": {"infer_ms": result.total_ms},
                }))
                prev_total_ms = (time.monotonic() - t0) * 1e3
        except websockets.ConnectionClosed:
            pass
        finally:
            log.info("vla_robot_disconnected", code=ws.close_code)
