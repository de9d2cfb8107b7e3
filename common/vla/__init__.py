"""Robion-style VLA edge scheduler.

Serves many robots' vision-language-action (VLA) requests on an edge server under latency SLOs:
a two-stage model (VLM, then an action diffusion transformer), a lockstep serving engine that
runs the two stages concurrently, a profiler, a management engine (placement + integer-program
traffic control), a discrete-event simulator driven by the same scheduler code, baselines, and
an openpi-compatible websocket policy endpoint. See docs/vla.md.

Submodules import torch lazily where they can, so that `ow --help` stays fast.
"""
