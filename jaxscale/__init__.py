"""jaxscale: named-mesh parallel training for JAX."""

__version__ = "0.1.0"
