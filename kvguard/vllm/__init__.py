"""kvguard inside vLLM: a KV connector whose transfers are kvguard requests.

The vLLM-facing class lives in ``kvguard.vllm.connector``; it and
``stats`` (vLLM's stats and Prometheus classes) are the only modules here
that import vLLM. Load it with::

    kv_transfer_config={"kv_connector": "KVGuardConnector",
                        "kv_connector_module_path": "kvguard.vllm.connector", ...}

The rest is vLLM-free and type-checked with kvguard:

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
* ``ranks``: tensor parallelism -- which KV heads each rank holds, and which
  prefill ranks write a decode rank's blocks (its *legs*).
* ``decode_legs``: a decode request's load across its legs -- loaded only
  when every leg loaded, failed only once no leg may still write.

Nothing in the libraries (``lifecycle``, ``transfer``, ``scheduler``) imports
this package: kvguard runs without vLLM.
See docs/vllm.md.
"""
