"""The version of jaxscale: one place, read by the package, its metadata (pyproject.toml) and runs."""

__version__ = "0.1.0"
