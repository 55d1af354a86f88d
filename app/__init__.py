"""Inference Lab's desktop application (PySide6 + pyqtgraph). Runs the engine in its own process."""

import os

# Qt's raster engine splits large fills over its own thread pool and waits for the pieces on a semaphore. Beside a
# decode that keeps both cores busy, each wait is for a descheduled pool thread, so the GUI spends more CPU per
# token and stalls longer with the pool than without it (BENCHMARKS.md, "The app against the CLI"). Set before any
# QGuiApplication exists; a user's own setting wins.
os.environ.setdefault("QT_NO_GUI_THREADPOOL", "1")
