"""Benchmarks of every kernel against its peers: ``python -m benchmarks``."""
