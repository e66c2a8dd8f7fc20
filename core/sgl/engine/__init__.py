"""The runtime: the scheduler process, the model runner and its batches.

``sgl.Engine``, the in-process engine programs use, is an entry point above this package
(:mod:`sgl.entrypoints.engine`).
"""
