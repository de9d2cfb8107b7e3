"""`ow vla load`: robots at 2 Hz against a real policy endpoint (openpi websocket wire format).

Each robot is one websocket connection to `URL/<model>` (openpi's client: metadata first, then one
msgpack-numpy observation per request, one reply each). It sends at `rate_hz` from a random phase,
as the simulator's robots do; the SLO clock starts at the robot's tick. A robot still waiting for
its previous chunk sends the next observation as soon as that chunk arrives (one request in flight
per connection, as openpi's synchronous client does), and the wait counts against the SLO.

Network delay emulation: each request waits an uplink delay before it is sent and its reply a
downlink delay after it arrives, drawn from the simulator's `NetworkModel` (WiFi 7-like), so a
run on loopback sees the delays robots on the factory network would.

Reported per model (never pooled alone): requests, answered, errors, SLO attainment, p50, p99,
and which GPU (`gpu` in the reply) served them. Requests sent during the first `warmup_s` are
served but not counted; a request unanswered at the end counts as a miss.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import numpy as np
import websockets
from websockets.asyncio.client import connect

from common.vla.sim import NetworkModel
from common.vla.wire import packb, unpackb

# The WiFi 7-like link the robots reach the server over; frozen, so one instance serves as the default.
DEFAULT_NETWORK = NetworkModel()


@dataclass
class ModelLoad:
    model: str
    robots: int
    slo_ms: float
    latencies_ms: list[float] = field(default_factory=list)  # measured requests; inf = unanswered
    errors: list[str] = field(default_factory=list)
    gpus: dict[str, int] = field(default_factory=dict)  # GPU / server label -> replies

    @property
    def requests(self) -> int:
        return len(self.latencies_ms)

    @property
    def answered(self) -> int:
        return sum(1 for v in self.latencies_ms if math.isfinite(v))

    @property
    def met(self) -> int:
        return sum(1 for v in self.latencies_ms if math.isfinite(v) and v <= self.slo_ms)

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0

    def percentile(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        return float(np.percentile(np.asarray(self.latencies_ms), q, method="higher"))

    def to_json(self) -> dict:
        return {
            "robots": self.robots,
            "slo_ms": self.slo_ms,
            "requests": self.requests,
            "answered": self.answered,
            "errors": len(self.errors),
            "first_errors": self.errors[:3],
            "attainment": self.attainment,
            "p50_ms": self.percentile(50),
            "p99_ms": self.percentile(99),
            "gpus": self.gpus,
        }


@dataclass
class LoadReport:
    url: str
    duration_s: float
    rate_hz: float
    network: str
    models: dict[str, ModelLoad]

    @property
    def worst_attainment(self) -> float:
        return min((m.attainment for m in self.models.values()), default=1.0)

    def lines(self) -> list[str]:
        out = [
            f"load: {sum(m.robots for m in self.models.values())} robots at {self.rate_hz:g} Hz for "
            f"{self.duration_s:g} s against {self.url} (network: {self.network})",
            f"{'model':14} {'robots':>6} {'SLO ms':>7} {'requests':>8} {'answered':>8} {'errors':>6} "
            f"{'attain':>7} {'p50 ms':>8} {'p99 ms':>8}  served by",
        ]
        for m in self.models.values():
            served = ", ".join(f"{g}: {n}" for g, n in sorted(m.gpus.items())) or "-"
            out.append(
                f"{m.model:14} {m.robots:6} {m.slo_ms:7.1f} {m.requests:8} {m.answered:8} {len(m.errors):6} "
                f"{m.attainment:7.1%} {m.percentile(50):8.1f} {m.percentile(99):8.1f}  {served}"
            )
        for m in self.models.values():
            if m.errors:
                out.append(f"{m.model}: {len(m.errors)} error(s), first: {m.errors[0]}")
        out.append(f"worst model attainment: {self.worst_attainment:.1%}")
        return out

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "duration_s": self.duration_s,
            "rate_hz": self.rate_hz,
            "network": self.network,
            "worst_attainment": self.worst_attainment,
            "models": {k: v.to_json() for k, v in self.models.items()},
        }


def observation(rng: np.random.Generator, prompt: str = "put the bowl on the plate") -> dict:
    """A LIBERO-style observation as openpi's LIBERO example sends it."""
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.standard_normal(8),
        "prompt": prompt,
    }


async def _robot(
    url: str,
    model: str,
    index: int,
    load: ModelLoad,
    *,
    rate_hz: float,
    duration_s: float,
    warmup_s: float,
    network: NetworkModel | None,
    seed: int,
    token: str | None,
    t_start: float,
    slo_override: float | None,
    drain_s: float,
) -> None:
    rng = np.random.default_rng([seed, index])
    frames = [packb(observation(rng)) for _ in range(4)]  # encoded once: the generator stays light
    headers = {"Authorization": f"Api-Key {token}"} if token else None
    period = 1.0 / rate_hz
    ticks = np.arange(rng.uniform(0.0, period), duration_s, period)
    measured = [t >= warmup_s for t in ticks]
    results: list[float] = [math.inf] * len(ticks)
    loop = asyncio.get_running_loop()
    deadline = t_start + duration_s + drain_s
    try:
        async with connect(
            f"{url.rstrip('/')}/{model}", additional_headers=headers, max_size=None, compression=None, open_timeout=60
        ) as ws:
            first = await ws.recv()
            if isinstance(first, str):  # the server refused the model path
                raise websockets.InvalidMessage(first)
            meta = unpackb(first)
            if isinstance(meta, dict) and slo_override is None and "slo_ms" in meta:
                load.slo_ms = float(meta["slo_ms"])
            for k, tick in enumerate(ticks):
                now = loop.time() - t_start
                up, down = network.delays(rng, 1) if network else (np.zeros(1), np.zeros(1))
                await asyncio.sleep(max(0.0, tick - now) + float(up[0]))
                await ws.send(frames[k % len(frames)])
                reply = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - loop.time()))
                await asyncio.sleep(float(down[0]))
                if isinstance(reply, str):
                    load.errors.append(reply)
                    continue
                body = unpackb(reply)
                results[k] = (loop.time() - t_start - tick) * 1e3
                label = str(body.get("gpu", body.get("served_by", "?"))) if isinstance(body, dict) else "?"
                load.gpus[label] = load.gpus.get(label, 0) + 1
    except (TimeoutError, OSError, websockets.WebSocketException) as exc:
        load.errors.append(f"robot {model}#{index}: {type(exc).__name__}: {exc}")
    load.latencies_ms.extend(r for r, m in zip(results, measured, strict=True) if m)


async def run_load_async(
    url: str,
    robots: dict[str, int],
    *,
    rate_hz: float = 2.0,
    duration_s: float = 10.0,
    warmup_s: float = 1.0,
    network: NetworkModel | None = DEFAULT_NETWORK,
    seed: int = 0,
    token: str | None = None,
    slo_ms: float | None = None,
    drain_s: float = 10.0,
) -> LoadReport:
    loads = {m: ModelLoad(m, n, slo_ms if slo_ms is not None else math.inf) for m, n in robots.items() if n > 0}
    loop = asyncio.get_running_loop()
    t_start = loop.time() + 0.5  # every robot connects first, then the clock starts
    tasks, index = [], 0
    for m, load in loads.items():
        for _ in range(load.robots):
            tasks.append(
                _robot(
                    url,
                    m,
                    index,
                    load,
                    rate_hz=rate_hz,
                    duration_s=duration_s,
                    warmup_s=warmup_s,
                    network=network,
                    seed=seed,
                    token=token,
                    t_start=t_start,
                    slo_override=slo_ms,
                    drain_s=drain_s,
                )
            )
            index += 1
    await asyncio.gather(*tasks)
    label = (
        "none"
        if network is None
        else (
            f"WiFi 7-like: {network.base_ms:g} ms + lognormal jitter (median "
            f"{network.jitter_median_ms:g} ms) + payload at {network.uplink_mbps:g} Mb/s"
        )
    )
    return LoadReport(url, duration_s, rate_hz, label, loads)


def run_load(url: str, robots: dict[str, int], **kw) -> LoadReport:
    return asyncio.run(run_load_async(url, robots, **kw))
