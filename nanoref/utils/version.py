"""nanoref's version: pyproject.toml's (tests/test_packaging.py holds the two equal), importable from any layer (the
server's /version reads it here, not from the package metadata a folder on PYTHONPATH does not have)."""

__version__ = "0.1.0"
