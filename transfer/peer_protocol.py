"""The messages a decode peer and a prefill side exchange, validated strictly.

A peer advertises itself with one JSON object (one line on the wire)::

    {"kvguard": 1, "type": "peer", "session_id": "127.0.0.1:15503",
     "layout": {"num_layers": 2, "num_blocks": 64, "block_bytes": 4096, "kv_split": true},
     "regions": [[base, length], ...], "block_base": [base, ...]}

Everything in it ends up as engine addresses, so nothing is trusted: exact
keys, exact types (a ``true`` is not a 1), no duplicate keys, no NaN, bounded
sizes, regions that do not overlap and buffers that lie inside them. Any
violation raises ``PeerProtocolError`` naming the field.

The same module defines the command lines a receiver process serves on stdin
(``COMMANDS``: name -> allowed argument keys) and the per-block digest both
sides compute to compare a transfer byte for byte without shared memory.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Final

from .backend import PeerInfo, Region
from .errors import PeerProtocolError
from .layout import KVCache, KVLayout

__all__ = [
    "COMMANDS",
    "MAX_LIST_LEN",
    "MAX_MESSAGE_BYTES",
    "MAX_SESSION_ID_LEN",
    "PROTOCOL_VERSION",
    "Command",
    "block_digests",
    "check_reply",
    "encode_error",
    "encode_reply",
    "load_message",
    "parse_command",
    "parse_reply",
    "peek_command_id",
    "peer_info_from_message",
    "peer_info_to_message",
]

PROTOCOL_VERSION: Final = 1
MAX_MESSAGE_BYTES: Final = 1 << 20  # one line; a 4096-buffer peer message is ~100 KiB
MAX_LIST_LEN: Final = 1 << 16  # regions, bases, blocks per command
MAX_SESSION_ID_LEN: Final = 256
_MAX_ADDR: Final = 1 << 64  # engine addresses are uint64

_PEER_KEYS: Final = frozenset({"kvguard", "type", "session_id", "layout", "regions", "block_base"})

# Command name -> the argument keys it takes (besides "cmd"); anything else is
# rejected. The receiver's dispatch table has exactly these names.
COMMANDS: Final[Mapping[str, frozenset[str]]] = {
    "checksum": frozenset({"blocks"}),  # -> {"digests": [sha256 hex per block]}
    "zero": frozenset(),  # zero every buffer -> {}
    "ping": frozenset(),  # -> {"pid": int}
    "exit": frozenset(),  # reply, then exit
}


# Every command may carry an "id" (int), echoed in its reply, so that a parent
# that gave up waiting for one reply never mistakes it for the next one's.
_ID_LIMIT: Final = 1 << 63


@dataclass(frozen=True, slots=True)
class Command:
    """A validated receiver command. ``blocks`` is empty unless the command takes it."""

    cmd: str
    blocks: tuple[int, ...] = ()
    id: int | None = None


# -- JSON with no surprises -----------------------------------------------------


def _reject_constant(name: str) -> object:
    raise PeerProtocolError(f"non-finite number {name} in message")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise PeerProtocolError(f"duplicate key {key!r} in message")
        out[key] = value
    return out


def _load_object(raw: str | bytes, what: str) -> dict[str, object]:
    if not isinstance(raw, str | bytes):
        raise PeerProtocolError(f"{what} must be str or bytes, got {type(raw).__name__}")
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > MAX_MESSAGE_BYTES:
        raise PeerProtocolError(f"{what} is {size} bytes, limit {MAX_MESSAGE_BYTES}")
    try:
        obj = json.loads(raw, object_pairs_hook=_unique_keys, parse_constant=_reject_constant)
    except PeerProtocolError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, deep nesting
        raise PeerProtocolError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise PeerProtocolError(f"{what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: object, field: str, *, lo: int, hi: int) -> list[int]:
    """A JSON list of ints, each in [lo, hi)."""
    if not isinstance(value, list):
        raise PeerProtocolError(f"{field} must be a list, got {type(value).__name__}")
    if len(value) > MAX_LIST_LEN:
        raise PeerProtocolError(f"{field} has {len(value)} items, limit {MAX_LIST_LEN}")
    for i, item in enumerate(value):
        if not _is_int(item):
            raise PeerProtocolError(f"{field}[{i}] must be an int, got {item!r}")
        if not lo <= item < hi:
            raise PeerProtocolError(f"{field}[{i}] = {item} out of range [{lo}, {hi})")
    return value


def _session_id(value: object) -> str:
    if not isinstance(value, str):
        raise PeerProtocolError(f"session_id must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= MAX_SESSION_ID_LEN:
        raise PeerProtocolError(f"session_id must have 1..{MAX_SESSION_ID_LEN} characters")
    # It is handed to the engine as a host name: printable ASCII, no spaces.
    if not (value.isascii() and value.isprintable()) or any(c.isspace() for c in value):
        raise PeerProtocolError(f"session_id {value!r} must be printable ASCII without spaces")
    return value


# -- the peer message -------------------------------------------------------------


def peer_info_to_message(info: PeerInfo) -> str:
    """One JSON line (no newline) advertising ``info``; the inverse of the parser."""
    if not isinstance(info.layout, KVLayout):
        raise PeerProtocolError(f"peer {info.session_id} has no KVLayout to advertise")
    return json.dumps(
        {
            "kvguard": PROTOCOL_VERSION,
            "type": "peer",
            "session_id": info.session_id,
            "layout": info.layout.to_dict(),
            "regions": [[r.base, r.length] for r in info.regions],
            "block_base": list(info.block_base),
        },
        separators=(",", ":"),
    )


def peer_info_from_message(raw: str | bytes) -> PeerInfo:
    """Parse a peer message strictly; raise PeerProtocolError naming what is wrong.

    A receiver that failed to start sends an error reply instead: it is
    raised as the PeerProtocolError it describes.
    """
    msg = _load_object(raw, "peer message")
    if "ok" in msg:
        check_reply(msg)  # an error reply raises
    keys = set(msg)
    if keys != _PEER_KEYS:
        missing, unknown = sorted(_PEER_KEYS - keys), sorted(keys - _PEER_KEYS)
        raise PeerProtocolError(f"peer message keys: missing {missing}, unknown {unknown}")
    if not _is_int(msg["kvguard"]) or msg["kvguard"] != PROTOCOL_VERSION:
        raise PeerProtocolError(f"unsupported protocol version {msg['kvguard']!r}")
    if msg["type"] != "peer":
        raise PeerProtocolError(f"message type must be 'peer', got {msg['type']!r}")
    sid = _session_id(msg["session_id"])
    layout_obj = msg["layout"]
    if not isinstance(layout_obj, dict):
        raise PeerProtocolError(f"layout must be an object, got {type(layout_obj).__name__}")
    try:
        layout = KVLayout.from_dict(layout_obj)
    except ValueError as exc:
        raise PeerProtocolError(f"peer {sid}: bad layout: {exc}", peer=sid) from exc
    regions = _regions(msg["regions"], sid)
    bases = _int_list(msg["block_base"], "block_base", lo=1, hi=_MAX_ADDR)
    if len(bases) != layout.num_buffers:
        raise PeerProtocolError(
            f"peer {sid}: {len(bases)} block bases for {layout.num_buffers} buffers", peer=sid
        )
    size = layout.buffer_bytes
    for i, base in enumerate(bases):
        if not any(r.contains(base, size) for r in regions):
            raise PeerProtocolError(
                f"peer {sid}: buffer {i} [{base:#x}, +{size}) lies in no advertised region",
                peer=sid,
            )
    return PeerInfo(sid, regions, layout, block_base=tuple(bases))


def _regions(value: object, sid: str) -> tuple[Region, ...]:
    if not isinstance(value, list) or not value:
        raise PeerProtocolError(f"peer {sid}: regions must be a non-empty list", peer=sid)
    if len(value) > MAX_LIST_LEN:
        raise PeerProtocolError(f"peer {sid}: {len(value)} regions, limit {MAX_LIST_LEN}")
    out: list[Region] = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list) or len(pair) != 2:
            raise PeerProtocolError(f"peer {sid}: regions[{i}] must be [base, length]", peer=sid)
        base, length = _int_list(pair, f"regions[{i}]", lo=1, hi=_MAX_ADDR)
        if base + length > _MAX_ADDR:
            raise PeerProtocolError(f"peer {sid}: regions[{i}] ends past 2**64", peer=sid)
        out.append(Region(base, length))
    ordered = sorted(out, key=lambda r: r.base)
    for a, b in pairwise(ordered):
        if a.end > b.base:
            raise PeerProtocolError(
                f"peer {sid}: regions [{a.base:#x}, {a.end:#x}) and "
                f"[{b.base:#x}, {b.end:#x}) overlap",
                peer=sid,
            )
    return tuple(out)


# -- receiver commands --------------------------------------------------------------


def parse_command(raw: str | bytes, *, num_blocks: int) -> Command:
    """Validate one command line against ``COMMANDS`` and the receiver's block count."""
    msg = _load_object(raw, "command")
    cmd = msg.get("cmd")
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        raise PeerProtocolError(f"unknown command {cmd!r}; known: {sorted(COMMANDS)}")
    allowed = COMMANDS[cmd]
    unknown = sorted(set(msg) - allowed - {"cmd", "id"})
    missing = sorted(allowed - set(msg))
    if unknown or missing:
        raise PeerProtocolError(f"command {cmd!r}: missing {missing}, unknown {unknown}")
    cid = _command_id(msg)
    if "blocks" in allowed:
        blocks = _int_list(msg["blocks"], "blocks", lo=0, hi=num_blocks)
        return Command(cmd, tuple(blocks), cid)
    return Command(cmd, id=cid)


def _command_id(msg: Mapping[str, object]) -> int | None:
    cid = msg.get("id")
    if cid is None:
        return None
    if not isinstance(cid, int) or isinstance(cid, bool) or not 0 <= cid < _ID_LIMIT:
        raise PeerProtocolError(f"command id must be an int in [0, 2**63), got {cid!r}")
    return cid


def peek_command_id(raw: str | bytes) -> int | None:
    """The id of a command line that failed validation, if one can be read."""
    try:
        return _command_id(_load_object(raw, "command"))
    except PeerProtocolError:
        return None


def encode_reply(command: Command, **fields: object) -> str:
    reply = {"ok": True, "cmd": command.cmd, "id": command.id, **fields}
    return json.dumps(reply, separators=(",", ":"))


def encode_error(exc: BaseException, command_id: int | None = None) -> str:
    """A typed error line: the class name lets the caller re-raise the right type."""
    reply = {"ok": False, "id": command_id, "error": type(exc).__name__, "message": str(exc)}
    return json.dumps(reply, separators=(",", ":"))


def load_message(raw: str | bytes, what: str = "message") -> dict[str, object]:
    """Parse one line as a JSON object: size-limited, no duplicate keys, no NaN."""
    return _load_object(raw, what)


def parse_reply(raw: str | bytes) -> dict[str, object]:
    """A receiver's reply; raise PeerProtocolError for an error reply or a malformed one."""
    return check_reply(_load_object(raw, "reply"))


def check_reply(msg: dict[str, object]) -> dict[str, object]:
    """Return ``msg`` if it is a success reply; raise PeerProtocolError otherwise."""
    ok = msg.get("ok")
    if ok is True:
        return msg
    if ok is False:
        raise PeerProtocolError(f"receiver error {msg.get('error')}: {msg.get('message')}")
    raise PeerProtocolError(f"reply has no boolean 'ok': {str(msg)[:200]}")


# -- integrity ----------------------------------------------------------------------


def block_digests(cache: KVCache, blocks: Sequence[int]) -> list[str]:
    """sha256 hex of each block's bytes over every buffer, layout order.

    Both sides compute it (the receiver on request, the sender on its own
    source blocks), so equal lists mean the transfer was byte-exact (I7).
    """
    tensors = [t if t.device.type == "cpu" else t.cpu() for t in cache.tensors]
    size = cache.layout.block_bytes
    n = cache.layout.num_blocks
    out = []
    for blk in blocks:
        if not _is_int(blk) or not 0 <= blk < n:
            raise PeerProtocolError(f"block {blk!r} out of range [0, {n})")
        h = hashlib.sha256()
        for t in tensors:
            h.update(t[blk * size : (blk + 1) * size].numpy().data)
        out.append(h.hexdigest())
    return out
