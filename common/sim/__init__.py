"""Pure pieces of the lifecycle simulator that the ground, the testbench and the benchmarks share
(docs/architecture.md): no import of `flight`, `hil` or `ground`.

windows.py   power windows of a trace, and a task's remaining durable units walked across
             windows (boot and recovery per power-up, the unit in flight at a cut lost)
"""
