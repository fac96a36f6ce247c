"""qkov_lib: the shared library of the qkov book (Vashisht & Ramaswamy, ICML 2026)."""

import os as _os

__version__ = "0.1.0"

#: set by the book runner (:mod:`qkov_lib.tooling.bookrun`) for a chapter it runs in the background
BACKGROUND_ENV = "QKOV_BACKGROUND_NICE"


def _background_priority() -> None:
    """A chapter kernel that the book runs in the background takes the niceness in
    ``$QKOV_BACKGROUND_NICE`` for its whole session. A Jupyter kernel leads a session of its own, and
    Linux (autogroup scheduling) shares the CPU fairly among sessions whatever the niceness of
    their processes, so the kernel sets its session's niceness too. Only a session leader does so:
    nothing changes for the shell or the process that started the book."""
    nice = _os.environ.get(BACKGROUND_ENV)
    if not nice or _os.getsid(0) != _os.getpid():
        return
    try:
        with open("/proc/self/autogroup", "w") as fh:
            fh.write(str(int(nice)))
    except (OSError, ValueError):
        pass  # no autogroup scheduling here: the process niceness inherited from the runner is enough


_background_priority()
