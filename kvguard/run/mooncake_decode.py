"""The decode side of ``kvguard run`` on real Mooncake: a decode service.

Plain ``kvguard run`` starts one as a local child (``ReceiverProcess``), which
it can kill or freeze; ``kvguard run --decode HOST:PORT`` drives one that
``kvguard decode --listen HOST:PORT`` runs elsewhere. Either way the run
talks to it over the same control channel (``kvguard.decode.control``).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING

import zmq

from kvguard.curve import ClientKeys
from kvguard.decode.control import DecodeClient, endpoint_of
from kvguard.decode.service import ReceiverProcess
from transfer import KVLayout, PeerInfo
from transfer.metadata import MetadataMode, mode_of
from transfer.mooncake import MooncakeBackend

if TYPE_CHECKING:
    from .records import RunConfig

__all__ = ["MooncakeDecode", "start_mooncake_decode"]

# Engine calls stuck on a frozen peer return after MC_TRANSFER_TIMEOUT; the
# minimum the engine accepts keeps their blocks quarantined for 5 s, not 30.
_ENGINE_TIMEOUT_S = 5
_CONNECT_TIMEOUT_S = 10.0  # a remote service that does not answer its first request
# Any of these means the service cannot answer (dead, frozen, gone, lying):
# the run counts the request unverified and stops asking.
_UNANSWERED = (TimeoutError, OSError, RuntimeError, ValueError, zmq.ZMQError)


class MooncakeDecode:
    """A decode service the run verifies through; kill/freeze need a local child."""

    peer: PeerInfo

    def __init__(
        self, client: DecodeClient, peer: PeerInfo, proc: ReceiverProcess | None, timeout_s: float
    ) -> None:
        self._client = client
        self.peer = peer
        self._proc = proc  # None: a remote service, not ours to stop
        # A local child that exits ends a wait at once; a remote one, its deadline.
        self._alive = proc.check_alive if proc is not None else None
        self._timeout_s = timeout_s
        self._lock = threading.Lock()  # one request at a time; guards _gone
        self._gone = False  # killed, frozen or unresponsive: stop asking

    def digests(self, blocks: list[int]) -> bytes | None:
        """DIGEST_SIZE bytes per destination block, one round trip; None if the
        service cannot answer now (None for good once the run killed or froze it)."""
        with self._lock:
            if self._gone:
                return None
            try:
                return self._client.checksums(blocks, timeout=self._timeout_s, alive=self._alive)
            except _UNANSWERED:
                return None  # the caller may ask again: a cut link heals

    def kill(self) -> None:
        with self._lock:
            self._gone = True
        self._local("--kill-decode-after").kill()

    def freeze(self) -> None:
        self._gone = True
        self._local("--freeze-decode-after").freeze()

    def _local(self, option: str) -> ReceiverProcess:
        if self._proc is None:
            raise ValueError(f"{option} needs a local decode service, not --decode")
        return self._proc

    def close(self) -> None:
        """Stop a local child; leave a remote service running for the next run."""
        if self._proc is not None:
            self._proc.close()
        else:
            self._client.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _route_ip(endpoint: str) -> str:
    """This host's address on the route to ``endpoint`` (no packet is sent)."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP connect only picks a route
        return str(s.getsockname()[0])


def _connect(cfg: RunConfig, layout: KVLayout, timeout_s: float) -> MooncakeDecode:
    address = str(cfg.decode)
    names = ("--curve-secret", "--curve-server")
    keys = ClientKeys.configured("kvguard run", names, cfg.curve_secret, cfg.curve_server)
    client = DecodeClient(address, timeout_s=timeout_s, curve=keys)
    try:
        peer = client.peer(timeout=_CONNECT_TIMEOUT_S)
        if peer.layout != layout:
            raise ValueError(
                f"--decode {address} serves {peer.layout}, this run needs {layout}: "
                "start it with the same --layers/--blocks/--block-bytes"
            )
        # A previous run's bytes could make a transfer that never landed look intact.
        client.zero(timeout=timeout_s)
    except BaseException:
        client.close()
        raise
    return MooncakeDecode(client, peer, None, timeout_s)


def start_mooncake_decode(
    cfg: RunConfig, layout: KVLayout
) -> tuple[MooncakeBackend, MooncakeDecode]:
    timeout_s = max(2.0, cfg.deadline_s)
    p2p = mode_of(cfg.metadata) is MetadataMode.P2P
    if not p2p:
        # A decode restarted under its old name publishes new buffers; without
        # a refresh the engine keeps using the dead one's cached descriptor.
        # Read when the engine module loads, so set before the first backend.
        os.environ.setdefault("MC_TE_METADATA_REFRESH_INTERVAL_SECONDS", "1")
    if cfg.decode is not None:
        decode = _connect(cfg, layout, timeout_s)
        local_ip = _route_ip(endpoint_of(cfg.decode))
    else:
        proc = ReceiverProcess(
            layout,
            metadata=cfg.metadata,
            ip="127.0.0.1" if p2p else f"127.0.0.1:{_free_port()}",
        )
        try:
            peer = proc.start()
        except BaseException:
            proc.close()
            raise
        decode = MooncakeDecode(proc.client, peer, proc, timeout_s)
        local_ip = "127.0.0.1"
    try:
        # In a metadata mode the session name is "ip:port" and must be unique
        # in the store; the port is only a label (the engine picks its own).
        name = local_ip if p2p else f"{local_ip}:{_free_port()}"
        backend = MooncakeBackend(name, metadata=cfg.metadata, transfer_timeout_s=_ENGINE_TIMEOUT_S)
    except BaseException:
        decode.close()
        raise
    # The backend writes only inside regions it was told about ("learn or
    # replace": a scheduler that forwards its own add_peer does no harm).
    backend.add_peer(decode.peer)
    return backend, decode
