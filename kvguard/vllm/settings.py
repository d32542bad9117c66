"""The connector's settings: the ``kvguard_*`` keys of ``kv_connector_extra_config``.

Both sides of the connector (scheduler and worker, prefill and decode) read
the same settings from vLLM's ``kv_transfer_config``; ``Settings.of`` checks
them once, at start, and a bad one raises ValueError naming the key and
value. docs/vllm.md's "Settings" table describes each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kvguard.curve import ClientKeys, ServerKeys
from transfer.affinity import parse_cpus
from transfer.mooncake import MooncakeBackend, engine_peer_budget

__all__ = ["Settings"]

_PREFIX: Final = "kvguard_"
_PROTOCOLS: Final = ("tcp", "rdma")  # what kvguard's backend is built and documented for
# An idle step's wait delays new requests by as much: beyond this, a typo.
_MAX_IDLE_WAIT_MS: Final = 100.0


@dataclass
class Settings:
    host: str = "127.0.0.1"  # advertised to peers: Mooncake session and control endpoint
    control_port: int = 17600  # prefill only: where decodes connect
    deadline_s: float = 10.0  # per request unless kv_transfer_params say otherwise
    max_deadline_s: float = 60.0  # the most a client's kvguard_deadline_s may ask for
    # prefill: how long finished blocks wait for a decode to ask, renewed by a
    # decode whose request queues, never past max_hold_s in all.
    hold_s: float = 30.0
    max_hold_s: float = 300.0
    # decode: a ZeroMQ ping every heartbeat_s; a prefill silent for
    # heartbeat_timeout_s after a ping drops its link. A freeze is detected
    # between the timeout and the timeout plus one interval after it began
    # (docs/vllm.md), so the interval is a small part of the timeout.
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    # prefill: kvguard transfers in flight at once; 0 follows the engine's own
    # per-peer entry budget (every transfer is at least one entry, and the
    # backend's engine loop holds entries beyond that budget back itself).
    max_inflight: int = 0
    protocol: str = "tcp"  # Mooncake's transport: "rdma" where a NIC exists
    max_attempts: int = 3  # kvguard's bounded retries of retryable transfer errors
    fault_rate: float = 0.0  # testing: inject faults into kvguard's backend
    fault_seed: int = 0
    fault_kinds: tuple[str, ...] = ("error_code", "raise", "fail_batch")
    fault_rank: int = -1  # the tensor parallel rank that injects them; -1: every rank
    # CPUs for kvguard's, ZeroMQ's and Mooncake's threads in the worker: ""
    # every CPU of the process (vLLM pins the worker's thread to one core),
    # a list ("0-3,6"), or "inherit" (the worker thread's own mask).
    cpus: str = ""
    # decode: check each load's digest against the prefill's (``integrity``);
    # a mismatch fails the load, and vLLM's kv_load_failure_policy applies.
    # prefill: read each hold's blocks for it as the hold begins.
    verify: bool = True
    # An engine step that runs no forward while this rank holds or loads KV
    # waits up to this long for a hold or load to end, instead of returning
    # at once: vLLM then steps again after 1 ms, and that loop takes the CPUs
    # the transfer needs. New requests and aborts reach an engine waiting so
    # at most this much later. 0: never wait.
    idle_wait_ms: float = 5.0
    # CURVE keys of the control channel (kvguard.curve), paths: this side's
    # NAME.key_secret; prefill: a directory of the decodes' allowed NAME.key
    # files; decode: the prefills' public NAME.key. None set: unauthenticated.
    curve_secret: str = ""
    curve_allowed: str = ""
    curve_server: str = ""

    @classmethod
    def of(cls, extra: dict[str, Any]) -> Settings:
        s = cls()
        for key, value in extra.items():
            if not key.startswith(_PREFIX):
                continue
            name = key[len(_PREFIX) :]
            if not hasattr(s, name):
                raise ValueError(f"unknown kvguard setting {key!r}")
            default = getattr(s, name)
            if isinstance(default, bool) and not isinstance(value, bool):  # bool("false") is True
                raise ValueError(f"{key} must be true or false, got {value!r}")
            setattr(s, name, tuple(value) if isinstance(default, tuple) else type(default)(value))
        if not 0 < s.deadline_s <= s.max_deadline_s:
            raise ValueError(
                f"kvguard_deadline_s must be > 0 and <= kvguard_max_deadline_s "
                f"({s.max_deadline_s}), got {s.deadline_s}"
            )
        if s.max_inflight < 0:
            raise ValueError(f"kvguard_max_inflight must be >= 0, got {s.max_inflight}")
        if s.protocol not in _PROTOCOLS:
            raise ValueError(f"kvguard_protocol must be one of {_PROTOCOLS}, got {s.protocol!r}")
        if not 0 < s.hold_s <= s.max_hold_s:
            raise ValueError(
                f"kvguard_hold_s must be > 0 and <= kvguard_max_hold_s ({s.max_hold_s}), "
                f"got {s.hold_s}"
            )
        if not 0 <= s.idle_wait_ms <= _MAX_IDLE_WAIT_MS:
            raise ValueError(
                f"kvguard_idle_wait_ms must be >= 0 and <= {_MAX_IDLE_WAIT_MS}, "
                f"got {s.idle_wait_ms}"
            )
        try:
            parse_cpus(s.cpus)
        except ValueError as exc:
            raise ValueError(f"kvguard_cpus: {exc}") from None
        return s

    def server_keys(self) -> ServerKeys | None:
        """Prefill: its CURVE keys, or None without any; ValueError names a
        missing half or a file that cannot be read."""
        names = ("kvguard_curve_secret", "kvguard_curve_allowed")
        return ServerKeys.configured("a prefill", names, self.curve_secret, self.curve_allowed)

    def client_keys(self) -> ClientKeys | None:
        """Decode: its CURVE keys, or None without any; ValueError as ``server_keys``."""
        names = ("kvguard_curve_secret", "kvguard_curve_server")
        return ClientKeys.configured("a decode", names, self.curve_secret, self.curve_server)

    @property
    def endpoint(self) -> str:
        """The control endpoint a prefill tells decodes: its rank 0's."""
        return f"tcp://{self.host}:{self.control_port}"

    def inflight(self) -> int:
        """Prefill: kvguard transfers in flight at once."""
        return self.max_inflight or engine_peer_budget()

    def make_backend(self) -> MooncakeBackend:
        # MC_FORCE_TCP would override the protocol: set it only when TCP is asked for.
        # A peer that answers no probe for the heartbeat timeout is gone: the
        # same bound as a silent link, so a slow host's first handshake is not
        # a lost peer sooner than a frozen one is.
        return MooncakeBackend(
            self.host,
            protocol=self.protocol,
            force_tcp=self.protocol == "tcp",
            probe_timeout_s=self.heartbeat_timeout_s,
        )
