"""Continuous batching over KV slots, and the prefix cache that seeds new lanes."""
