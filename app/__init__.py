"""Inference Lab's desktop application (PySide6 + pyqtgraph). Runs the engine in its own process."""

import os

# Qt's raster engine splits large fills over its own thread pool and waits for the pieces on a semaphore. Beside a
# decode that keeps both cores busy, each wait is for a descheduled pool thread: measured with every panel live,
# the GUI spent 11.3 ms of CPU per token with the pool and 8.3 ms without it (stall worst 85 → 38 ms). Set before
# any QGuiApplication exists; a user's own setting wins.
os.environ.setdefault("QT_NO_GUI_THREADPOOL", "1")
