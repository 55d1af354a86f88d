"""GUI start-up cost: import the app, build the window (no model load), print JSON.

    python -m benchmarks.startup

Prints the seconds to import the app, to build and show the window, and the GUI process's peak RSS (MB), and
whether torch got loaded into it (it must not: torch lives in the engine process, which this does not start
loading a model in). Run it a few times: a busy 2-core machine makes single numbers noisy.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time


def main() -> int:
    t0 = time.perf_counter()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6 import QtWidgets

    app = QtWidgets.QApplication.instance() or QtWidgets.QApplication([sys.argv[0]])
    from app.main_window import MainWindow

    t1 = time.perf_counter()
    window = MainWindow(persist=False, load=False, interactive=False)
    window.show()
    app.processEvents()
    t2 = time.perf_counter()
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    window.close()
    print(json.dumps({"import_s": round(t1 - t0, 3), "window_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3),
                      "gui_max_rss_mb": round(rss_mb, 1), "torch_loaded": "torch" in sys.modules}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
