"""The distribution's version, in a module of its own so any layer can read it without importing the SDK."""

__version__ = "0.1.0"
