"""The decode service (``kvguard decode``): a Mooncake-registered KV cache
advertised to prefills (``service``), the parent that holds one as a child
(``process``), its command-line arguments (``args``) and the ZeroMQ control
channel both sides speak (``control``)."""

__all__: list[str] = []
