"""Trace-driven simulator of the whole request lifecycle (docs/sim.md).

models.py     model dimensions (real Qwen3-VL / Qwen2.5-VL sizes, or a model directory) and
              record sizes from the record encoder
platform.py   what each unit of work, read and write costs: a Jetson target from FLOP and
              byte counts, or the real-process testbench's pacing and throttling
lifecycle.py  one request across power windows: boot, phases, plans, writes, cuts
validate.py   the simulator against real testbench runs
figures.py    the paper's Figures 10-14 at the real model sizes
"""
