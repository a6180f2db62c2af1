"""The `specdec` command line (entry point `specdec.cli:main`); the commands live in this package's modules."""
from specdec.cli.app import main

__all__ = ["main"]
