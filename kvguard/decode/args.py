"""The command-line options of a decode service (``kvguard decode``,
``python -m kvguard.decode.service``), in a module that imports neither torch nor
the engine, so that ``kvguard --help`` stays fast."""

from __future__ import annotations

import argparse

from transfer.metadata import P2P_HANDSHAKE

__all__ = ["add_service_arguments"]


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvguard decode`` and ``python -m kvguard.decode.service``.

    Defaults match ``kvguard run``'s, so the two fit without repeating them.
    """
    parser.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="control channel address (port 0: any free port), or an ipc:// path",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--block-bytes", type=int, default=8192)
    parser.add_argument("--no-kv-split", action="store_true", help="one buffer per layer (MLA)")
    parser.add_argument(
        "--ip",
        default=None,
        metavar="ADDR",
        help="the engine's address, told to peers (default: the --listen host, else 127.0.0.1)",
    )
    parser.add_argument("--metadata", default=P2P_HANDSHAKE, help="P2PHANDSHAKE or a server URL")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--exit-with-stdin", action="store_true", help="also stop when stdin closes"
    )
    parser.add_argument(
        "--curve-secret",
        metavar="FILE",
        help="this service's CURVE key pair (NAME.key_secret of `kvguard keygen`); "
        "with --curve-allowed, only clients holding an allowed key talk",
    )
    parser.add_argument(
        "--curve-allowed",
        metavar="DIR",
        help="a directory of the allowed clients' public keys (NAME.key files)",
    )
