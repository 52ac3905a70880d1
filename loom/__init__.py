"""Loom: an inference server for small machines."""
__version__ = "0.1.0"


def resource(name):
    """A shipped folder (opencl, models): beside the package in a checkout or an
    editable install, under <prefix>/share/loom after a regular install."""
    import os
    import sys
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name)
    installed = os.path.join(sys.prefix, "share", "loom", name)
    return here if os.path.isdir(here) or not os.path.isdir(installed) else installed
