"""Benchmark scripts printing side-by-side ratios (not tests)."""
