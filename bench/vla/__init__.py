"""VLA edge-scheduler benchmarks (Robion-style vs Monolithic vs vLLM-Omni-style)."""
