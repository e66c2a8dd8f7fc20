"""``python -m sgl`` is the ``sgl`` command."""

from sgl.cli import main

main()
