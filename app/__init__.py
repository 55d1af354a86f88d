"""Inference Lab's desktop application (PySide6 + pyqtgraph). Runs the engine in its own process."""
