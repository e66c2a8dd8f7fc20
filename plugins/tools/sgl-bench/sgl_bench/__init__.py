"""``sgl bench``: serving, offline and one-batch benchmarks as an sgl command plugin."""

__all__: list[str] = []
