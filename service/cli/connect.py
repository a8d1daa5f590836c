"""How the `stencild` client commands reach a server: address, TLS, API key.

One place for the connection options of `generate`, `embed` and `say`. Only
grpc is imported, and only when a channel is opened, so `--help` stays quick.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from service.address import host_port
from service.cli.flags import BadFlag

DEFAULT_PORT = 50051
API_KEY_ENV = "STENCILD_API_KEY"


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--host, --port, --timeout, the TLS files and the API key."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    tls = p.add_argument_group("TLS (any of these turns it on)")
    tls.add_argument("--tls-ca", type=Path, default=None, metavar="FILE",
                     help="CA certificate (PEM) to verify the server with (default: the system's)")
    tls.add_argument("--tls-cert", type=Path, default=None, metavar="FILE",
                     help="client certificate (PEM), for servers that require one (mTLS)")
    tls.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="the client certificate's key")
    p.add_argument("--api-key", default=None,
                   help=f"API key sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})")


def open_channel(args: argparse.Namespace) -> Any:
    """A grpc channel to the server `args` name: TLS when a TLS file is given.

    Unusable options end the command (exit code 2), as a bad flag would.
    """
    import grpc

    target = host_port(args.host, args.port)
    # Take whatever the server may send (its own limit, --max-message-mb,
    # bounds it): grpc's 4 MiB default failed a large Embed answer here
    # after the server had computed and sent it.
    options = [("grpc.max_receive_message_length", -1)]
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return grpc.insecure_channel(target, options=options)
    try:
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=args.tls_ca.read_bytes() if args.tls_ca is not None else None,
            private_key=args.tls_key.read_bytes() if args.tls_key is not None else None,
            certificate_chain=args.tls_cert.read_bytes() if args.tls_cert is not None else None)
    except (OSError, ValueError) as err:
        print(f"stencild: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return grpc.secure_channel(target, credentials, options=options)


def call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The metadata every call sends (the API key, if any). BadFlag for a key
    gRPC cannot send (metadata is printable ASCII): it failed as INTERNAL."""
    key = args.api_key or os.environ.get(API_KEY_ENV)
    if not key:
        return ()
    if not all(" " < c <= "~" for c in key):
        flag = "--api-key" if args.api_key else f"${API_KEY_ENV}"
        raise BadFlag(flag, ValueError("an API key is printable ASCII without spaces"))
    return (("authorization", f"Bearer {key}"),)
