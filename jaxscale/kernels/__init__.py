"""Attention kernels: the blockwise (flash) attention in plain JAX, and the platform kernels that
share its interface."""
