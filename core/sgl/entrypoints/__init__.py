"""What programs call into: ``sgl.Engine``, the in-process engine over the server's tokenizer
manager and the scheduler process. The CLI (``sgl.cli``) sits above it, the server below."""
