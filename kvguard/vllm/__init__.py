"""kvguard inside vLLM: a KV connector whose transfers are kvguard requests.

Shaped like vLLM's own connectors (``nixl/``). Load it with::

    kv_transfer_config={"kv_connector": "KVGuardConnector",
                        "kv_connector_module_path": "kvguard.vllm.connector", ...}

The modules that import vLLM:

* ``connector``: ``KVGuardConnector``, a thin facade that builds a scheduler
  side or a worker side by role and hands each of vLLM's hooks to it.
* ``scheduler_side``: ``KVGuardScheduler``, in the engine core: requests in,
  one ``metadata.KVGuardMetadata`` per step out (holds, loads, forgets,
  renews, cancels: typed structs).
* ``worker``: ``KVGuardWorker``, one per tensor parallel rank: the Mooncake
  engine, the sender or receiver, what vLLM hears of each transfer.
* ``stats`` (the payload vLLM carries), ``stats_sampling`` (each step's
  change, on the worker) and ``stats_prometheus`` (``/metrics``).

The rest is vLLM-free and type-checked with kvguard:

* ``params``: every ``kv_transfer_params`` key, parsed and checked once
  (the PD proxy imports the keys it sets from it); ``settings``: the
  ``kvguard_*`` keys of ``kv_connector_extra_config``.
* ``protocol``: the msgspec messages the two sides exchange over ZeroMQ.
* ``states``: the hand-off's state machines as tables (a prefill's hold and
  each push of it, a decode's load, its link to a prefill, a request's legs)
  and ``LoadEnd``, every way a load ends.
* ``prefill_core`` (with ``admission``, ``peer_ledger``, ``prefill_records``)
  and ``decode_core`` (with ``decode_links``, ``decode_records``): the
  decisions of each side, sans I/O -- events and ``now`` in, ``actions`` out.
* ``prefill_pushes``: the prefill's driver -- a ROUTER socket and a kvguard
  ``Scheduler`` around ``PrefillCore``; blocks go back to the engine only
  after kvguard released every transfer into them (terminal AND quiesced).
* ``decode_loads``: the decode's driver -- a DEALER per prefill, its
  monitor and probes around ``DecodeCore``.
* ``ranks``: tensor parallelism -- which KV heads each rank holds, which
  prefill ranks write a decode rank's blocks (its *legs*) and where they
  listen.
* ``kv_views``: vLLM's per-layer KV cache views, in any of its six
  layouts, as kvguard buffers (which bytes of each block move, in how many
  engine entries), the layout fingerprint, and the refusal of hybrid models.
* ``decode_legs``: a decode request's load across its legs -- loaded only
  when every leg loaded, failed only once no leg may still write.
* ``reader_spin``: a vLLM general plugin, not the connector: bounds how long
  vLLM's queue readers busy-wait where ``KVGUARD_VLLM_READER_SPIN_S`` asks
  (servers that share cores).

Nothing in the libraries (``lifecycle``, ``transfer``, ``scheduler``) imports
this package: kvguard runs without vLLM.
See docs/vllm.md.
"""
