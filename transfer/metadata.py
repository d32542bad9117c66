"""The engine's metadata store: which mode a connection string names, and the
keys a session leaves behind.

In HTTP or etcd mode every engine publishes two keys under its session name
(``mooncake/[<cluster id>/]rpc_meta/<name>`` and ``.../ram/<name>``) and
removes them in its destructor. A process killed with SIGKILL never does,
and the store then refuses the same name when the process comes back
("Duplicate rpc_meta key not allowed"). ``clear_stale`` is what a restarting
decode service calls before it initializes its engine: the keys of its own
name can only belong to a dead predecessor (a live one would still hold the
name's port, so this process could not be starting under it).

Talks to the stores with the standard library only: the HTTP server's
``DELETE ?key=``, and etcd's v3 JSON gateway (``POST /v3/kv/deleterange``),
which etcd >= 3.4 serves on its client port.
"""

from __future__ import annotations

import base64
import enum
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Final

import structlog

__all__ = ["P2P_HANDSHAKE", "MetadataMode", "clear_stale", "metadata_keys", "mode_of"]

_log = structlog.get_logger("kvguard.transfer")

P2P_HANDSHAKE: Final = "P2PHANDSHAKE"  # the engine's own spelling: no metadata store


class MetadataMode(enum.Enum):
    P2P = "p2p"  # no store: peers exchange descriptors directly
    HTTP = "http"  # the wheel's mooncake_http_metadata_server, or mooncake_master's
    ETCD = "etcd"
    REDIS = "redis"  # accepted by the engine; kvguard does not clean it (no client)


def mode_of(metadata: str) -> MetadataMode:
    """The mode the engine picks for this connection string (as it parses it)."""
    if metadata == P2P_HANDSHAKE:
        return MetadataMode.P2P
    scheme = metadata.split("://", 1)[0].lower() if "://" in metadata else "etcd"
    try:
        return {
            "http": MetadataMode.HTTP,
            "https": MetadataMode.HTTP,
            "etcd": MetadataMode.ETCD,
            "redis": MetadataMode.REDIS,
        }[scheme]
    except KeyError:
        raise ValueError(f"unknown metadata scheme in {metadata!r}") from None


def metadata_keys(name: str) -> tuple[str, str]:
    """The two keys a session named ``name`` publishes, honouring MC_METADATA_CLUSTER_ID."""
    cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "").strip("/")
    prefix = f"mooncake/{cluster}/" if cluster else "mooncake/"
    return f"{prefix}rpc_meta/{name}", f"{prefix}ram/{name}"


def clear_stale(metadata: str, name: str, timeout: float = 3.0) -> int:
    """Delete ``name``'s keys from the store; how many existed. 0 in P2P mode.

    Raises OSError when the store cannot be reached within ``timeout``: a
    restart that cannot clean up would fail at initialize anyway, later and
    less clearly.
    """
    mode = mode_of(metadata)
    if mode is MetadataMode.P2P:
        return 0
    if mode is MetadataMode.REDIS:
        _log.warning(
            "stale_metadata_not_cleared",
            metadata=metadata,
            name=name,
            reason="no redis client in kvguard: delete the keys yourself",
        )
        return 0
    deleted = 0
    for key in metadata_keys(name):
        deleted += (_delete_http if mode is MetadataMode.HTTP else _delete_etcd)(
            metadata, key, timeout
        )
    if deleted:
        _log.info("stale_metadata_cleared", metadata=metadata, name=name, keys=deleted)
    return deleted


def _delete_http(url: str, key: str, timeout: float) -> int:
    req = urllib.request.Request(f"{url}?key={urllib.parse.quote(key, safe='')}", method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return 1
    except urllib.error.HTTPError as exc:
        if exc.code == 404:  # nothing stale: the usual case
            return 0
        raise OSError(f"metadata server {url}: DELETE {key} answered {exc.code}") from exc


def _delete_etcd(metadata: str, key: str, timeout: float) -> int:
    hostport = metadata.split("://", 1)[-1].split(",")[0].strip("/")
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request(
        f"http://{hostport}/v3/kv/deleterange",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = json.loads(r.read(1 << 16))
    return int(reply.get("deleted", 0)) if isinstance(reply, dict) else 0
