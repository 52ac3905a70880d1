"""Loom: an inference server for small machines."""
__version__ = "0.1.0"
