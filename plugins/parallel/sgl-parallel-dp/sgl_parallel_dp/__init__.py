"""Data parallelism for sgl (``--dp-size``): see :mod:`sgl_parallel_dp.strategy`."""
