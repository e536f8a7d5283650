"""The package version (its own module: importing it imports nothing else)."""

__version__ = "0.1.0"
