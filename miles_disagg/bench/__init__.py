"""Benchmarks: each prints exactly one JSON object on stdout (progress goes to stderr)."""
