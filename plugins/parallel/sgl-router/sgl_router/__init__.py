"""``sgl router``: SGLang's router in front of sgl workers (see :mod:`sgl_router.command`)."""
