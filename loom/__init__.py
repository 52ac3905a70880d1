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


def cache_folder(name):
    """$XDG_CACHE_HOME/loom/NAME (else ~/.cache/loom/NAME): generated checkpoints, built kernels."""
    import os
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "loom", name)


def open_regular(path):
    """A regular file opened for reading, else OSError: a FIFO or device named as a
    source, checkpoint or tokenizer would block (or never end) a preparation worker.
    O_NONBLOCK makes even the open of a FIFO return at once."""
    import os
    import stat
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
