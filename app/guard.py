"""A Python exception in a Qt callback must never take the app down.

PySide6 cannot hand an exception back through C++: one escaping an event filter or another virtual override
(eventFilter, paintEvent…) leaves Qt with no return value, and the process dies (SIGSEGV, measured here on
PySide6 6.10). One escaping a slot or a timer is printed through `sys.excepthook` and the app goes on, unseen.

So the boundaries are guarded: `@guarded` wraps event filters, the shared draw timer and the bridge's slots; it
logs the exception with its traceback, reports it (the main window shows it in the status bar) and returns a safe
value. `install_excepthook()` routes everything else that reaches `sys.excepthook` (an unguarded slot) the same way.
Reports of the same exception at the same place are logged once, so a broken paint at 30 Hz does not flood the log.
"""

from __future__ import annotations

import functools
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from PySide6 import QtCore

log = logging.getLogger("app")

F = TypeVar("F", bound=Callable[..., Any])


class ErrorReporter(QtCore.QObject):
    """Collects the exceptions caught at Qt boundaries; the main window shows the newest one."""

    sig_error = QtCore.Signal(str)
    """One line for the user: where it happened and what was raised."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0  # exceptions caught since start
        self.last = ""
        self._seen: set[tuple[str, str]] = set()

    def report(self, where: str, exc: BaseException) -> None:
        self.count += 1
        message = f"{where}: {type(exc).__name__}: {exc}"
        key = (where, f"{type(exc).__name__}: {exc}")
        if key not in self._seen:
            self._seen.add(key)
            log.error("exception in %s\n%s", where,
                      "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        self.last = message
        self.sig_error.emit(message)


_reporter: ErrorReporter | None = None


def reporter() -> ErrorReporter:
    """The process's one ErrorReporter (created on first use, in the GUI thread)."""
    global _reporter
    if _reporter is None:
        _reporter = ErrorReporter()
    return _reporter


def report(where: str, exc: BaseException) -> None:
    """Log `exc` and tell the user, without raising anything (this runs inside Qt callbacks)."""
    try:
        reporter().report(where, exc)
    except Exception:  # noqa: BLE001 — reporting itself must never be what kills the app
        traceback.print_exception(type(exc), exc, exc.__traceback__)


def guarded(fn: F | None = None, *, default: Any = None) -> F | Callable[[F], F]:
    """Wrap a Qt callback: an exception is reported and `default` is returned instead.

    `@guarded` or `@guarded(default=False)` (an event filter must return a bool: False lets the event go on).
    """

    def wrap(f: F) -> F:
        where = f.__qualname__

        @functools.wraps(f)
        def inner(*args: Any, **kwargs: Any) -> Any:
            try:
                return f(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 — this is the boundary: nothing may pass it
                report(where, e)
                return default

        return inner  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


def install_excepthook() -> None:
    """Send every uncaught exception of the GUI process (an unguarded slot or timer) to the reporter."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
            return
        if exc is not None and exc.__traceback__ is None:
            exc = exc.with_traceback(tb)
        frames = traceback.extract_tb(tb)
        where = frames[-1].name if frames else "a Qt callback"
        report(where, exc if exc is not None else exc_type())

    sys.excepthook = hook
