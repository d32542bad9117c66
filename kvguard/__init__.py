"""kvguard, the application: what users run on top of the three libraries.

* ``kvguard.cli``: the ``kvguard`` command (``run``, ``decode``, ``proxy``,
  ``trace``, ``diagram``, ``bench``).
* ``kvguard.run``: the ``kvguard run`` job, prefill and decode on real
  Mooncake with every DONE request verified byte for byte.
* ``kvguard.decode``: the decode service (``kvguard decode``) and its
  ZeroMQ control channel.
* ``kvguard.proxy``: the PD proxy (``kvguard proxy``), vLLM's two-step
  protocol with a deadline and a typed error on each leg.
* ``kvguard.vllm``: ``KVGuardConnector``, kvguard as a vLLM KV connector.

It depends on ``scheduler`` -> ``transfer`` -> ``lifecycle``; none of them
imports it. Importing this package loads nothing else (``kvguard --help``
stays fast).
"""

__all__: list[str] = []
