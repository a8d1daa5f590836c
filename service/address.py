"""Host names as the flags take them and as grpc and HTTP servers want them.

`--host ::` (every IPv6 interface) or `--host ::1` cannot be glued to a port
with a colon: grpc read `:::50051` as something else entirely (`::0` bound
port 443). grpc targets and bind addresses put an IPv6 literal in brackets;
socket-level servers (the metrics endpoint) want it without.
"""

from __future__ import annotations


def bare_host(host: str) -> str:
    """`host` without the brackets of a bracketed IPv6 literal (`[::1]` -> `::1`)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """`host:port` for grpc, an IPv6 literal in brackets (`::1`, 50051 -> `[::1]:50051`)."""
    host = bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
