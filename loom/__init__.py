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


# The model roots (--model_root) of a serving process: real paths of the folders whose files
# it may read for a model (sources, checkpoints, assets, includes). None: unconfined (the
# library in another program, the command-line tools). The server sets them at start.
_roots = None


def confine(roots):
    """Set the model roots (folders; None: unconfined); returns the previous setting."""
    import os
    global _roots
    previous = _roots
    _roots = None if roots is None else tuple(sorted({os.path.realpath(r) for r in roots}))
    return previous


def model_roots():
    return _roots


def outside_roots(path):
    """Whether `path`, its symlinks followed, lies outside every model root (False when
    nothing is confined). A path that does not exist resolves as far as it does."""
    import os
    if _roots is None:
        return False
    real = os.path.realpath(path)
    return not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in _roots)


def open_regular(path):
    """A regular file opened for reading, else OSError: a FIFO or device named as a
    source, checkpoint or tokenizer would block (or never end) a preparation worker.
    O_NONBLOCK makes even the open of a FIFO return at once. Under model roots, a file
    that resolves outside them is refused before a byte is read: the check is on the file
    actually opened (/proc/self/fd), so a symlink swapped in meanwhile cannot escape."""
    import os
    import stat
    if outside_roots(path):
        raise OSError(f"{path} resolves outside the model roots (--model_root)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if _roots is not None:
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                opened = None       # no /proc: the check above stands
            if opened is not None and outside_roots(opened):
                raise OSError(f"{path} resolves outside the model roots (--model_root)")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
