"""jaxscale: named-mesh parallel training for JAX."""

from jaxscale.version import __version__

__all__ = ["Trainer", "__version__"]


def __getattr__(name: str):
    # Imported on first use: `import jaxscale` (e.g. by the launcher) should not load JAX.
    if name == "Trainer":
        from jaxscale.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'jaxscale' has no attribute {name!r}")
