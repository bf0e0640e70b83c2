"""Benchmark harness: memory sampler, throughput runs, tuner and plots.

Imports the core; the core never imports it.
"""
