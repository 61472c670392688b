"""What start-up banners may show of a connection URL: scheme, host, port and path, never credentials.

    redact_url("redis://:s3cret@redis.internal:6380/2?password=x")  ->  "redis://redis.internal:6380/2"
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["redact_url"]


def redact_url(url: str) -> str:
    """`url` without user, password, query or fragment (a Redis URL may carry a password in any of them)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}{parts.path}" if parts.scheme else "<unparsable URL>"
