"""The panels, one per file. Each module exposes PANEL, a subclass of app.panels.base.Panel."""

from __future__ import annotations

# Panels in the groups a person looks for them by; the order is the View menu's and the default layout's.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("The live run", ("prompt", "preview", "generation", "sampling", "attention", "kv_cache", "timeline", "roofline",
                      "lens", "branches", "constrain")),
    ("What-if labs", ("capacity", "batching", "speculative", "scheduling")),
    ("The server", ("load_lab", "requests", "server_blocks", "fleet")),
    ("Why it answers", ("why", "steer")),
)
PANEL_MODULES = tuple(name for _, names in GROUPS for name in names)
GROUP_OF = {name: group for group, names in GROUPS for name in names}
