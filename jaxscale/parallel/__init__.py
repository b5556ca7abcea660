"""Parallelism beyond what sharding rules express: context-parallel attention."""
