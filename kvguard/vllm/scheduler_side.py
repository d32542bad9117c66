"""The connector's scheduler side: vLLM's requests in, one ``KVGuardMetadata`` per step out.

It runs in the engine core, beside vLLM's scheduler, and does no I/O: it
reads each request's ``kv_transfer_params`` (through ``params``) and tells
the workers what to do this step (``metadata``).

* prefill: ``request_finished`` of a request asked to hold its KV (finished
  by its one token) keeps its blocks (True) and returns the decode's
  ``kv_transfer_params``; the step's ``holds`` carry the blocks to the
  workers, which free them once ``finished_sending`` says so.
* decode: a request whose params name a kvguard prefill loads its whole
  prompt, asynchronously (``get_num_new_matched_tokens``); from its arrival
  until its blocks are allocated it renews the prefill's hold (``renews``);
  once allocated it becomes one of the step's ``loads``; one that leaves
  first is ``forgets``, and one aborted while loading ``cancels``.

The decode requests that load one prefill request are a *group* (vLLM's
n > 1 children): each load tells the prefill the group's size, so it holds
the blocks until every child has asked or said it never will.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from vllm.v1.request import RequestStatus

from .metadata import ForgetMeta, HoldMeta, KVGuardMetadata, LoadMeta
from .params import (
    LoadAsk,
    Source,
    deadline_s,
    load_ask,
    loaded_tokens,
    loading_started,
    prefill_reply,
    source_of,
    wants_hold,
    wants_load,
)
from .settings import Settings

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVGuardScheduler"]

_RECENT: Final = 4096  # external_tokens kept, for inspection and tests


@dataclass
class _Group:
    """Decode requests that load one prefill request: n > 1 children, repeats.

    vLLM's API server adds the children one message at a time, so the
    engine may step, allocate and push one before the next arrives; the
    prefill holds its blocks until the whole group is settled.
    """

    waiting: set[str] = field(default_factory=set)  # arrived, not allocated, not finished
    live: set[str] = field(default_factory=set)  # pushed, not finished
    pushed: int = 0  # loads sent (each request pushes at most once)
    declared: int = 0  # the size the client declared (kvguard_loads); 0: none
    left: int = 0  # requests that left before any push, the prefill not told

    def size(self) -> int:
        """What a push tells the prefill: those that pushed or still may,
        arrived or declared (the prefill keeps the largest it heard, and
        counts forgets against it)."""
        return max(self.pushed + len(self.waiting), self.declared - self.left)

    def idle(self) -> bool:
        return not self.waiting and not self.live


@dataclass
class _Queued:
    """A decode request waiting for its blocks: what it asks, its next renewal."""

    ask: LoadAsk
    due: float  # time.monotonic()
    tokens: int  # of its prompt, to load (params.loaded_tokens; 0: none, another prompt's KV)


class KVGuardScheduler:
    """The scheduler side of ``KVGuardConnector``, for one engine (one role)."""

    def __init__(
        self, settings: Settings, *, producer: bool, tp_size: int, text: bool = True
    ) -> None:
        self.settings = settings
        self.is_producer = producer
        self.tp_size = tp_size  # the engine's: a prefill tells decodes
        self.text = text  # whether the server returns text (a prefill tells the proxy)
        self.endpoint = settings.endpoint  # prefill: rank 0's control endpoint
        self._meta = KVGuardMetadata()  # this step's, until build_connector_meta
        self._loading: set[str] = set()  # decode: loads handed to the worker, not yet reported
        self._holding: set[str] = set()  # prefill: holds handed to the worker, not yet released
        self._queued: dict[str, _Queued] = {}  # decode: arrived, blocks not yet allocated
        self._groups: dict[tuple[str, str], _Group] = {}  # decode: by Source.key
        self._members: dict[str, tuple[str, str]] = {}  # decode: pushed request -> its group
        # decode: tokens loaded, for the last _RECENT requests (inspection, tests)
        self.external_tokens: OrderedDict[str, int] = OrderedDict()

    def _ask(self, params: dict[str, Any]) -> LoadAsk:
        s = self.settings
        return load_ask(params, deadline=s.deadline_s, max_deadline=s.max_deadline_s, hold=s.hold_s)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.is_producer or not wants_load(request.kv_transfer_params):
            return 0, False
        queued = self._queued.get(request.request_id)
        if queued is not None:
            tokens = queued.tokens
        else:  # not seen arriving (vLLM calls on_new_request first)
            assert request.kv_transfer_params is not None
            tokens = loaded_tokens(request.kv_transfer_params, request.prompt_token_ids or ())
        count = tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def on_new_request(self, request: Request) -> None:
        """Decode: from its arrival until its blocks are allocated, renew the
        prefill's hold of a request that will load (it may queue long)."""
        params = request.kv_transfer_params
        if self.is_producer or not wants_load(params):
            return
        assert params is not None
        ask = self._ask(params)  # parsed once: kept until allocation or finish
        tokens = loaded_tokens(params, request.prompt_token_ids or ())
        self._group(ask).waiting.add(request.request_id)
        if tokens == 0:  # another prompt's KV: the prefill lets go now, nothing renews it
            loading_started(params)
            self._not_loading(request.request_id, ask.source)
            return
        # Due at once: one not allocated in its first step renews the hold
        # then, which the path here (proxy, API servers) has used part of.
        self._queued[request.request_id] = _Queued(ask, time.monotonic(), tokens)

    def _group(self, ask: LoadAsk) -> _Group:
        """The group loading ``ask``'s source, its declared size raised to
        what this request's ``kvguard_loads`` says."""
        group = self._groups.setdefault(ask.source.key, _Group())
        group.declared = max(group.declared, ask.declared)
        return group

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if self.is_producer or not wants_load(params):
            return
        assert params is not None
        rid = request.request_id
        loading_started(params)  # one load per request
        queued = self._queued.pop(rid, None)
        ask = queued.ask if queued is not None else self._ask(params)
        if num_external_tokens <= 0:
            self._not_loading(rid, ask.source)
            return
        block_ids = blocks.get_unhashed_block_ids_all_groups()[0]
        deadline = time.monotonic() + ask.deadline_s
        group = self._group(ask)
        size = group.size()  # before this request leaves "waiting"
        group.waiting.discard(rid)
        group.live.add(rid)
        group.pushed += 1
        self._members[rid] = ask.source.key
        self._meta.loads.append(LoadMeta(rid, list(block_ids), ask.source, deadline, size))
        self._loading.add(rid)
        self.external_tokens[rid] = num_external_tokens
        while len(self.external_tokens) > _RECENT:
            self.external_tokens.popitem(last=False)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVGuardMetadata:
        meta, self._meta = self._meta, KVGuardMetadata()
        now = time.monotonic()
        for queued in self._queued.values():
            if queued.due <= now:
                meta.renews.append(queued.ask.source)
                queued.due = now + queued.ask.renew_s
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)
        for rid in connector_output.finished_sending or ():
            self._holding.discard(rid)

    def in_flight(self) -> bool:
        """Whether the workers hold or load KV for this engine: one will end
        (``idle``: a step with nothing to run may wait for it)."""
        return bool(self._holding or self._loading)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        rid = request.request_id
        queued = self._queued.pop(rid, None)
        if not params:
            return False, None
        if not self.is_producer:
            if wants_load(params):
                # Finished (aborted) before its blocks were allocated.
                loading_started(params)
                self._not_loading(rid, queued.ask.source if queued else source_of(params))
            else:
                self._ungroup(rid)
            if rid in self._loading:
                self._meta.cancels.append(rid)  # vLLM waits for finished_recving
            return False, None
        if not wants_hold(params):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            return False, None  # aborted or errored: nothing to hand off
        s = self.settings
        used = deadline_s(params, s.deadline_s, s.max_deadline_s)
        self._meta.holds.append(HoldMeta(rid, list(block_ids), time.monotonic() + s.hold_s))
        self._holding.add(rid)
        reply = prefill_reply(
            endpoint=self.endpoint,
            request_id=rid,
            deadline=used,
            hold=s.hold_s,
            tp_size=self.tp_size,
            prompt=request.prompt_token_ids or (),
            text=self.text,
        )
        return True, reply

    def _not_loading(self, rid: str, source: Source) -> None:
        """``rid`` of ``source``'s group will never push. While the group has
        pushed nothing and others wait, the later pushes carry the smaller
        size; otherwise the prefill is told (an Abort without load id, which
        the link delivers after every push sent before it)."""
        group = self._groups.get(source.key)
        if group is None:
            self._meta.forgets.append(ForgetMeta(source, 1))
            return
        size = group.size()  # with rid: the prefill counts its forget against it
        group.waiting.discard(rid)
        if group.pushed or not group.waiting:
            self._meta.forgets.append(ForgetMeta(source, max(size, 1)))
        else:  # the later pushes carry the smaller size
            group.left += 1
        if group.idle():
            del self._groups[source.key]

    def _ungroup(self, rid: str) -> None:
        """A decode request that pushed finished; its group ends with the last."""
        key = self._members.pop(rid, None)
        group = None if key is None else self._groups.get(key)
        if key is not None and group is not None:
            group.live.discard(rid)
            if group.idle():
                del self._groups[key]
