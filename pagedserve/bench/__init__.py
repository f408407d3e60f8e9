"""Benchmarks: offline throughput, decode latency sweep, roofline efficiency."""
