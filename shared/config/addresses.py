"""Listen addresses ("host:port", ":port", "[::1]:port") and endpoint URLs."""

from __future__ import annotations

from urllib.parse import urlsplit

ANY_HOST = "0.0.0.0"


def parse_hostport(address: str) -> tuple[str, int]:
    """Split "host:port" into (host, port); ":port" means every interface (0.0.0.0).

    IPv6 hosts are written in brackets ("[::1]:8080") and returned without them. The port must be an
    integer in 0..65535 (0 asks the OS for a free port). Raises ValueError naming the problem.
    """
    if not isinstance(address, str):
        raise ValueError(f'expected "host:port" or ":port", got {address!r}')
    text = address.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError(f'expected "host:port" or ":port", got {address!r}')
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"malformed IPv6 address in {address!r}")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f'IPv6 hosts need brackets, e.g. "[::1]:8080", got {address!r}')
    if not port_text.isdigit():
        raise ValueError(f"port must be a number in 0..65535, got {port_text!r} in {address!r}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port must be a number in 0..65535, got {port} in {address!r}")
    if any(ch.isspace() for ch in host):
        raise ValueError(f"host must not contain spaces, got {address!r}")
    return (host or ANY_HOST), port


def parse_http_url(url: str) -> tuple[str, str, int | None]:
    """Return (scheme, host, explicit port or None) of an http(s) URL; raise ValueError otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("expected an http:// or https:// URL")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"malformed URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"URL must start with http:// or https://, got {url!r}")
    if not parts.hostname:
        raise ValueError(f"URL has no host: {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"URL must not carry a query or fragment: {url!r}")
    return parts.scheme, parts.hostname, port
