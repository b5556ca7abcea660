"""A run while it lives: its session on a workdir, the loop and its hooks, resuming, health,
the multi-process runtime, and what the process sets before JAX starts.
"""
