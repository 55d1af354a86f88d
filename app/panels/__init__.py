"""The panels, one per file. Each module exposes PANEL, a subclass of app.panels.base.Panel."""

from __future__ import annotations

# Order = the order of the View menu and of the default layout.
PANEL_MODULES = (
    "prompt", "preview", "generation", "sampling", "attention", "kv_cache", "timeline", "roofline", "capacity",
    "batching", "lens", "branches", "load_lab", "constrain",
)
