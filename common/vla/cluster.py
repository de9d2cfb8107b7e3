"""Scale-out past one edge server: the controller's plan as Ray Serve deployments.

Each GPU of the plan becomes one Ray Serve deployment (`GpuServer`, named `gpu<N>`) that owns one
GPU (`num_gpus=1`, or one unit of a stand-in resource) and runs the models the plan put on it
with their own `LockstepScheduler` and `ServingEngine` — the scheduler sits inside each
deployment, exactly as on one server. A `Gateway` deployment is the robots' endpoint: the same
openpi websocket protocol as `ow vla serve` (metadata, msgpack-numpy observations, text error
frames, `Authorization: Api-Key` robot keys), behind Ray Serve's HTTP proxy. It routes each robot,
for its whole connection, to a GPU hosting its model with unused places in the plan (`Router`),
and forwards each observation's bytes through a deployment handle.

When a server dies, Ray Serve starts the lost deployments' replicas again wherever GPUs are free
(the models "come back" on the other servers); until then the gateway answers the robots of the
lost GPUs with an error frame, never with another model's or a wrong answer. The answer to an
observation does not depend on where it runs (noise seeded from the request bytes).

Needs `ray[serve]` (the `cluster` extra). See docs/vla.md for running it on real machines.
"""

# No `from __future__ import annotations` here: FastAPI must see the real WebSocket annotation
# through Ray Serve's class-based view, or it takes `ws` for a query parameter (close code 1008).
import asyncio
import logging
import os
import time
from typing import Any

import ray
from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from ray import serve

from common.vla.engine import ServingEngine
from common.vla.server import DEFAULT_MAX_REQUEST_BYTES, Router, answer, metadata, robot_for_key
from common.vla.wire import packb

APP_NAME = "orbitweaver-vla"
app = FastAPI(title="orbitweaver VLA gateway", docs_url=None, redoc_url=None, openapi_url=None)


class GpuServer:
    """One GPU of the plan: its models, their lockstep scheduler and engine (Ray Serve replica)."""

    def __init__(self, gpu: int, models: list[str], engine_options: dict):
        opts = dict(engine_options)
        self.gpu, self.models = gpu, list(models)
        self.max_request_bytes = opts.pop("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        warm = opts.pop("warm_up", True)
        self.engine = ServingEngine.build(self.models, **opts)
        if warm:
            self.engine.warm_up()
        self.engine.start()
        self.node = ray.get_runtime_context().get_node_id()
        self.where = {"gpu": gpu, "node": self.node, "pid": os.getpid()}

    async def infer(self, model: str, message: bytes, robot: str, prev_total_ms: float | None):
        reply, _ = await answer(
            self.engine,
            model,
            message,
            robot,
            self.max_request_bytes,
            prev_total_ms,
            {"gpu": self.gpu, "node": self.node},
        )
        return reply

    def metadata(self, model: str) -> dict:
        return metadata(self.engine, model, self.max_request_bytes, {"gpu": self.gpu, "node": self.node})

    def describe(self) -> dict:
        return {**self.where, "models": self.models, "served": self.engine.stats.served}

    def check_health(self) -> None:  # Ray Serve restarts a replica whose engine stopped
        thread = self.engine._thread
        if thread is None or not thread.is_alive():
            raise RuntimeError("the serving engine's coordinator thread is not running")


@serve.ingress(app)
class Gateway:
    """The robots' openpi endpoint; routes each robot to a GPU deployment of the plan."""

    def __init__(
        self, gpus: dict, quotas: dict, keys: dict | None, default_model: str, request_timeout_s: float = 60.0
    ):
        self.handles = {int(g): h for g, h in gpus.items()}
        order = sorted(self.handles)
        self.order = order
        self.router = Router([quotas[g] for g in order], [quotas[g] for g in order])
        self.keys, self.default_model = keys, default_model
        self.request_timeout_s = request_timeout_s
        self._meta: dict[str, dict] = {}

    @app.get("/healthz")
    def healthz(self) -> str:
        return "OK"

    async def _metadata(self, gpu: int, model: str) -> dict:
        key = f"{gpu}/{model}"
        if key not in self._meta:
            self._meta[key] = await self.handles[gpu].metadata.remote(model)
        return {**self._meta[key], "models": self.router.models()}

    @app.websocket("/{path:path}")
    async def robot(self, ws: WebSocket, path: str) -> None:
        name, reason = robot_for_key(self.keys, ws.headers.get("authorization"))
        if reason is not None:
            await ws.close(code=1008, reason=reason)  # before accept: the upgrade is refused
            return
        await ws.accept()
        peer = f"{ws.client.host}:{ws.client.port}" if ws.client else "?"
        robot = name or peer
        model = path.strip("/").removeprefix("models/") or self.default_model
        if model not in self.router.models():
            await ws.send_text(f"error: unknown model path {'/' + path!r}; serving {', '.join(self.router.models())}")
            await ws.close(code=1008)
            return
        index, _ = self.router.acquire(model)
        gpu = self.order[index]
        handle = self.handles[gpu]

        try:
            try:
                meta = await asyncio.wait_for(self._metadata(gpu, model), self.request_timeout_s)
            except Exception as exc:  # the GPU's server is gone: say so, and let the robot reconnect
                await ws.send_text(f"error: model {model} is unavailable on GPU {gpu} ({type(exc).__name__}); retry")
                await ws.close(code=1011)
                return
            await ws.send_bytes(packb(meta))
            prev_total_ms = None
            while True:
                message = await ws.receive()
                if message["type"] == "websocket.disconnect":
                    return
                data = message.get("bytes")
                if data is None:
                    await ws.send_text("error: expected a binary msgpack observation, got a text frame")
                    continue
                t0 = time.monotonic()
                try:
                    reply = await asyncio.wait_for(
                        handle.infer.remote(model, data, robot, prev_total_ms), self.request_timeout_s
                    )
                except Exception as exc:  # replica lost mid-request, or none yet: an error, never a guess
                    reply = f"error: GPU {gpu} serving {model} is unavailable ({type(exc).__name__}); retry"
                if isinstance(reply, str):
                    await ws.send_text(reply)
                else:
                    await ws.send_bytes(reply)
                    prev_total_ms = (time.monotonic() - t0) * 1e3
        except WebSocketDisconnect:
            return
        finally:
            self.router.release(index, model)


def build_app(
    layout: dict[int, dict[str, int]],
    *,
    engine_options: dict,
    keys: dict | None,
    default_model: str,
    gpu_resource: str = "GPU",
    gateway_resources: dict | None = None,
    request_timeout_s: float = 60.0,
):
    """The Serve application for a plan: `layout` is GPU -> {model: robots}."""
    gpu_opts: dict[str, Any]
    if gpu_resource == "GPU":
        gpu_opts = {"num_gpus": 1, "num_cpus": 0}
    else:  # a stand-in accelerator resource (CPU clusters, tests)
        gpu_opts = {"num_cpus": 0, "resources": {gpu_resource: 1}}
    # serve.deployment(cls) returns a Deployment; ray annotates only its decorator-factory form.
    gpu_deployment: Any = serve.deployment(GpuServer)
    handles = {}
    for g, robots in sorted(layout.items()):
        handles[g] = gpu_deployment.options(
            name=f"gpu{g}",
            num_replicas=1,
            ray_actor_options=dict(gpu_opts),
            health_check_period_s=5,
            graceful_shutdown_timeout_s=5,
        ).bind(g, sorted(robots), engine_options)
    gateway = serve.deployment(Gateway).options(  # type: ignore[attr-defined]  # as above
        name="gateway",
        num_replicas=1,
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0, **({"resources": gateway_resources} if gateway_resources else {})},
    )
    return gateway.bind(handles, {g: dict(r) for g, r in layout.items()}, keys, default_model, request_timeout_s)


def deploy(
    address: str,
    layout: dict[int, dict[str, int]],
    *,
    host: str,
    port: int,
    proxy_location: str,
    node_ip_address: str | None = None,
    **app_kw,
) -> None:
    """Connect to the Ray cluster, start Serve's proxy and run the application (returns when ready)."""
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, _node_ip_address=node_ip_address)
    serve.start(http_options={"host": host, "port": port, "location": proxy_location})
    serve.run(build_app(layout, **app_kw), name=APP_NAME, route_prefix="/", blocking=False)


def placements() -> dict[str, dict]:
    """Where each GPU deployment's replica runs now: name -> {node, pid, gpu, models, served}."""
    out: dict[str, dict] = {}
    app_status = serve.status().applications.get(APP_NAME)
    if app_status is None:
        return out
    for name in app_status.deployments:
        if name.startswith("gpu"):
            try:
                out[name] = serve.get_deployment_handle(name, APP_NAME).describe.remote().result(timeout_s=30)
            except Exception as exc:  # replica starting or lost
                out[name] = {"error": type(exc).__name__}
    return out


def shutdown() -> None:
    try:
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
