"""Benchmarks that time moeshard against a peer measured in the same process, on the same weights."""
