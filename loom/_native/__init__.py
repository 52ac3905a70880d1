"""Cython hot paths (framing, multipart) with pure-Python references beside them."""
