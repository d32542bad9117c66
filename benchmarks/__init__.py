"""kvguard benchmarks: each figure is a ratio against a baseline measured in the same run."""

__all__: list[str] = []
