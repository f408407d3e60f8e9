"""Monitoring: GPU and process collectors for /metrics, and `pagedserve top`."""
