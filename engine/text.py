"""Text the engine shows or is given that needs care: one printable line from untrusted text, and a server's
address checked without connecting (the credentials in it never shown)."""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import SplitResult, urlsplit

_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?")


def clean_text(text: str, limit: int = 200) -> str:
    """`text` as one printable line: terminal escape sequences and control characters removed, whitespace collapsed,
    at most `limit` characters."""
    s = _ESCAPES.sub("", text[: limit * 8])
    s = "".join(" " if unicodedata.category(ch)[0] == "C" else ch for ch in s)
    s = " ".join(s.split())
    return s if len(s) <= limit else s[: limit - 1].rstrip() + "…"


def display_url(url: str) -> str:
    """`url` without its `user:password@` part: the form shown in the status bar, messages and errors."""
    return re.sub(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?[^/?#]*@", r"\1", url.strip(), count=1)


def server_address(url: str) -> tuple[SplitResult, int | None]:
    """The parts of a server's http(s) URL (a bare host:port means http) and its port (None: the scheme's), or
    ValueError in one sentence naming the URL as display_url shows it."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    shown = display_url(url)
    if any(unicodedata.category(ch)[0] == "C" or ch.isspace() for ch in url):
        raise ValueError(f"not a server URL: {clean_text(shown, 120)!r} (it holds spaces or control characters)")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"not a server URL: {shown!r} (bad host or port)") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a server URL: {shown!r} (expected e.g. http://127.0.0.1:8000)")
    return parts, port
