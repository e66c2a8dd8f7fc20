"""Tensor parallelism for sgl (``--tp-size``, ``--nnodes``): see :mod:`sgl_parallel_tp.strategy`."""
