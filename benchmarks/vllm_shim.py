"""What ``benchmarks.vllm_pd`` patches inside the vLLM server processes it starts.

Never imported by kvguard. The benchmark starts each server with
``benchmarks/_site`` on PYTHONPATH; its ``sitecustomize`` calls
``install()`` in every Python process of the server (the API server, the
engine core and the worker: vLLM spawns them on CPU, so a patch made in the
parent alone would not reach them). With ``KVGUARD_BENCH_DIR`` unset it
does nothing. Each patch is applied when its module is first imported:

* ``torch.accelerator.current_device_index`` returns 0 on a host without an
  accelerator: vLLM's in-tree ``MooncakeConnector`` asks for the device
  index in its constructor and CPU torch raises there;
* the API server writes one line per finished request (``requests-*``):
  vLLM's own arrival time and first-token latency, the server's view of a
  request (arrival to first token), read by vLLM's frontend;
* every per-step hook of a connector class (kvguard's, Mooncake's, NIXL's)
  is timed (``hooks-*``, a snapshot every 0.5 s): the time vLLM's
  loop spends inside the connector; kvguard's doorbell waits inside
  ``build_connector_meta`` (``kvguard.vllm.idle``: an engine with nothing
  to run waiting for a transfer to end) are timed too, as ``IDLE_WAIT``,
  so that the figures can tell that waiting from the hooks' work;
* transfer events (``events-*``): kvguard's sender and receiver (hold,
  push, submit, release, outcome, report), Mooncake's batch write and
  NIXL's finished transfers (start, end, bytes), on one clock
  (``time.time()``, which vLLM's arrival time also uses).

Files go to ``$KVGUARD_BENCH_DIR`` named after ``$KVGUARD_BENCH_SERVER``
and the process id.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from .vllm_shim_sink import AfterImport, Sink

__all__ = ["CONNECTOR_HOOKS", "IDLE_WAIT", "install"]

ENV_DIR: Final = "KVGUARD_BENCH_DIR"
ENV_SERVER: Final = "KVGUARD_BENCH_SERVER"

# The per-step hooks of vLLM's KVConnectorBase_V1 (scheduler and worker
# side); register_kv_caches and shutdown run once and are left out.
CONNECTOR_HOOKS: Final = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "bind_connector_metadata",
    "clear_connector_metadata",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
)

IDLE_WAIT: Final = "idle_wait"  # kvguard's Doorbell.wait, inside build_connector_meta

_sink: Sink | None = None


def _installed() -> Sink:
    """This process's sink (a patch runs only after ``install()`` made it)."""
    assert _sink is not None
    return _sink


# -- the patches -----------------------------------------------------------------


def _device_index(accel: ModuleType) -> None:
    original = accel.current_device_index

    def current_device_index() -> int:
        return int(original()) if accel.is_available() else 0

    accel.current_device_index = current_device_index  # type: ignore[attr-defined]


def _request_stats(stats: ModuleType) -> None:
    cls = stats.IterationStats
    original = cls.update_from_finished_request
    sink = _installed()

    def update_from_finished_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        fin = self.finished_requests[-1]
        st = kwargs.get("req_stats")
        sink.request(
            {
                "request_id": fin.request_id,
                "finish_reason": str(fin.finish_reason),
                "arrival": getattr(st, "arrival_time", None),
                "first_token_latency": getattr(st, "first_token_latency", None),
                "e2e": fin.e2e_latency,
                "queued": fin.queued_time,
                "prefill": fin.prefill_time,
                "prompt_tokens": fin.num_prompt_tokens,
                "generated": fin.num_generation_tokens,
                "cached_tokens": fin.num_cached_tokens,
            }
        )
        return out

    cls.update_from_finished_request = update_from_finished_request


def _time_hooks(cls: type) -> None:
    sink = _installed()
    for name in CONNECTOR_HOOKS:
        fn = cls.__dict__.get(name)  # only what the class itself defines
        if not callable(fn):
            continue

        def timed(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                sink.hook_time(_name, time.perf_counter() - t0)

        timed.__name__ = name
        timed.__qualname__ = f"{cls.__qualname__}.{name}"
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        setattr(cls, name, timed)


def _wrap(cls: type, name: str, around: Callable[..., Any]) -> None:
    """``cls.name`` calls ``around(original, *args, **kwargs)``."""
    fn = getattr(cls, name, None)
    if fn is None:
        print(f"kvguard bench shim: {cls.__name__}.{name} is gone", file=sys.stderr)
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return around(fn, *args, **kwargs)

    setattr(cls, name, wrapped)


def _kvguard_connector(mod: ModuleType) -> None:
    from kvguard.vllm.params import DO_REMOTE_PREFILL, REQUEST_ID

    sink = _installed()
    cls = mod.KVGuardConnector

    def request_finished(fn: Any, self: Any, request: Any, block_ids: Any) -> Any:
        out = fn(self, request, block_ids)
        if out[0]:
            sink.event("finished", request=request.request_id, blocks=len(block_ids))
        return out

    def update_state_after_alloc(fn: Any, self: Any, request: Any, *args: Any) -> Any:
        params = dict(request.kv_transfer_params or {})
        out = fn(self, request, *args)
        if params.get(DO_REMOTE_PREFILL):
            sink.event("alloc", request=request.request_id, remote=params.get(REQUEST_ID))
        return out

    def get_transfer_results(fn: Any, self: Any, *args: Any) -> Any:
        out = fn(self, *args)
        for rid in out.finished_recving or ():
            sink.event("reported", request=rid, failed=rid in (out.failed_recving or ()))
        for rid in out.finished_sending or ():
            sink.event("freed", request=rid)
        return out

    _wrap(cls, "request_finished", request_finished)
    _wrap(cls, "update_state_after_alloc", update_state_after_alloc)
    _wrap(cls, "get_transfer_results", get_transfer_results)
    _time_hooks(cls)


def _kvguard_sender(mod: ModuleType) -> None:
    sink = _installed()
    from kvguard.vllm.protocol import Push, decode_from_decode

    cls = mod.PrefillSender

    def hold(fn: Any, self: Any, rid: str, blocks: Any, deadline: float) -> Any:
        sink.event("hold", request=rid, blocks=len(blocks))
        return fn(self, rid, blocks, deadline)

    def receive(fn: Any, self: Any, frames: list[bytes]) -> Any:
        if len(frames) == 2:
            try:
                msg = decode_from_decode(frames[1])
            except Exception:
                msg = None
            if isinstance(msg, Push):
                sink.event("push", request=msg.request_id, blocks=len(msg.blocks))
        return fn(self, frames)

    def submit(fn: Any, self: Any, act: Any) -> Any:
        t0 = time.time()
        out = fn(self, act)
        if not out:  # no submit_failed: the transfer is kvguard's
            sink.event("submitted", request=act.request_id, start=t0)
        return out

    def on_release(fn: Any, self: Any, rid: str, *args: Any) -> Any:
        fin = args[-1]  # (load id, transfer id, Finished) since n > 1 loads
        sink.event(
            "released",
            request=rid,
            ok=fin.state.name == "DONE",
            nbytes=fin.nbytes,
            engine_s=fin.latency_s,
        )
        return fn(self, rid, *args)

    # A turn's answers (Reply actions, results to decodes) go out at its end.
    replies: dict[int, int] = {}  # sender -> answers due this turn

    def apply(fn: Any, self: Any, actions: Any, later: list[Any]) -> Any:
        before = len(later)
        out = fn(self, actions, later)
        due = sum(isinstance(a, mod.Reply) for a in later[before:])
        replies[id(self)] = replies.get(id(self), 0) + due
        return out

    def turn(fn: Any, self: Any) -> Any:
        out = fn(self)
        if count := replies.pop(id(self), 0):
            sink.event("results_sent", count=count)
        return out

    _wrap(cls, "hold", hold)
    _wrap(cls, "_receive", receive)
    _wrap(cls, "_submit", submit)
    _wrap(cls, "_on_release", on_release)
    _wrap(cls, "_apply", apply)
    _wrap(cls, "_turn", turn)


def _kvguard_receiver(mod: ModuleType) -> None:
    sink = _installed()
    cls = mod.DecodeReceiver

    def expect(fn: Any, self: Any, rid: str, endpoint: str, remote: str, *args: Any) -> Any:
        sink.event("expect", request=rid, remote=remote)
        return fn(self, rid, endpoint, remote, *args)

    def take_finished(fn: Any, self: Any, *args: Any) -> Any:
        out = fn(self, *args)
        for o in out:
            sink.event("outcome", request=o.request_id, ok=o.ok, latency_s=o.latency_s)
        return out

    _wrap(cls, "expect", expect)
    _wrap(cls, "take_finished", take_finished)


def _mooncake_connector(mod: ModuleType) -> None:
    sink = _installed()

    def send_blocks(fn: Any, self: Any, session: str, src: Any, dst: Any, lengths: Any) -> Any:
        t0 = time.time()
        rc = fn(self, session, src, dst, lengths)
        sink.event("xfer", start=t0, nbytes=sum(lengths), entries=len(lengths), ok=rc == 0)
        return rc

    _wrap(mod.MooncakeConnectorWorker, "_send_blocks", send_blocks)
    _time_hooks(mod.MooncakeConnector)


def _nixl_stats(mod: ModuleType) -> None:
    sink = _installed()

    def record_transfer(fn: Any, self: Any, res: Any) -> Any:
        if res is not None:
            start = time.time() - res.xferDuration / 1e6  # xferDuration: microseconds
            sink.event("xfer", start=start, nbytes=res.totalBytes, entries=res.descCount, ok=True)
        return fn(self, res)

    _wrap(mod.NixlKVConnectorStats, "record_transfer", record_transfer)


def _nixl_connector(mod: ModuleType) -> None:
    _time_hooks(mod.NixlBaseConnector)  # most hooks; the pull side's own start_load_kv
    _time_hooks(mod.NixlPullConnector)


def _kvguard_doorbell(mod: ModuleType) -> None:
    sink = _installed()

    def wait(fn: Any, self: Any, timeout_s: float) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, timeout_s)
        finally:
            sink.hook_time(IDLE_WAIT, time.perf_counter() - t0)

    _wrap(mod.Doorbell, "wait", wait)


_V1: Final = "vllm.distributed.kv_transfer.kv_connector.v1"


def install() -> None:
    """Patch this process if the benchmark asked for it (``KVGUARD_BENCH_DIR``)."""
    global _sink
    out = os.environ.get(ENV_DIR)
    if not out or _sink is not None:
        return
    _sink = Sink(Path(out), os.environ.get(ENV_SERVER, "server"))
    sys.meta_path.insert(
        0,
        AfterImport(
            {
                "torch.accelerator": _device_index,
                "vllm.v1.metrics.stats": _request_stats,
                "kvguard.vllm.connector": _kvguard_connector,
                "kvguard.vllm.prefill_pushes": _kvguard_sender,
                "kvguard.vllm.decode_loads": _kvguard_receiver,
                "kvguard.vllm.idle": _kvguard_doorbell,
                f"{_V1}.mooncake.mooncake_connector": _mooncake_connector,
                f"{_V1}.nixl.stats": _nixl_stats,
                f"{_V1}.nixl.connector": _nixl_connector,
            }
        ),
    )
