"""A time limit on work that its input cannot bound beforehand (a template rendering, a regular
expression matching names): a SIGALRM timer, so in the main thread only, where Python delivers
signals (elsewhere, and inside a time limit already running, the work runs without one; what was
checked before it still holds). CPython's regex engine and Jinja's rendered code both check for
signals as they run, so the limit interrupts them."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Expired(Exception):
    """The work ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``Expired`` in the body once it has run ``seconds``."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def on_alarm(signum, frame):
        raise Expired

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
