"""The package version, defined once (pyproject.toml reads it; so does ``--version``)."""

__version__ = "0.1.0"
