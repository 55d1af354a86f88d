"""The bundle's entry point: PyInstaller freezes this script, not app/main.py.

The app runs its engine in a process started with multiprocessing's spawn; in a frozen app that child is the bundle's
own executable started again, and freeze_support() is what turns it into the engine instead of a second window.
"""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()
    from app.main import main

    sys.exit(main())
