"""kvguard scheduler: embed guaranteed-terminal KV transfers in a serving loop."""

__all__: list[str] = []
