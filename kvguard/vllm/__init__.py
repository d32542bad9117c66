"""kvguard inside vLLM: a KV connector whose transfers are kvguard requests.

The vLLM-facing class lives in ``kvguard.vllm.connector``; it and
``stats`` (vLLM's stats and Prometheus classes) are the only modules here
that import vLLM. Load it with::

    kv_transfer_config={"kv_connector": "KVGuardConnector",
                        "kv_connector_module_path": "kvguard.vllm.connector", ...}

The rest is vLLM-free and type-checked with kvguard:

* ``protocol``: the msgspec messages the two sides exchange over ZeroMQ.
* ``prefill_pushes``: the prefill side -- holds each finished request's blocks,
  pushes them through a kvguard ``Scheduler`` when the decode asks, and
  lets go of them only after kvguard released them (terminal AND quiesced),
  or at the hold deadline when no decode asked.
* ``decode_loads``: the decode side -- asks the prefill to push, and ends every
  wait at the first of: the prefill's verdict, the prefill's death (the
  TCP connection drops), its silence (ZeroMQ heartbeats) or the deadline.
* ``ranks``: tensor parallelism -- which KV heads each rank holds, and which
  prefill ranks write a decode rank's blocks (its *legs*).
* ``decode_legs``: a decode request's load across its legs -- loaded only
  when every leg loaded, failed only once no leg may still write.

Nothing in the libraries (``lifecycle``, ``transfer``, ``scheduler``) imports
this package: kvguard runs without vLLM.
See docs/vllm.md.
"""
