"""Names a plugin adds to the top level of ``sgl`` (``sgl.function``, ``sgl.gen``, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.hookspecs._marker import hookspec

if TYPE_CHECKING:
    from sgl.registry import RegisterFn


@hookspec
def sgl_register_api_names(register: RegisterFn) -> None:
    """Register names that ``import sgl`` exposes as attributes of the package.

    Call ``register(name, "module:attribute")``. The first time a program reads
    ``sgl.<name>``, the core builds the plugin registries (as ``sgl plugins`` would, honouring
    ``SGL_PLUGINS`` and ``SGL_DISABLE_PLUGINS``), imports the target and keeps it, so
    ``import sgl`` itself stays light. A name no loaded plugin registers is an
    ``AttributeError`` as for any module. Two plugins registering one name is an error naming
    both. The language plugin (sgl-lang) registers ``function``, ``gen``, ``select`` and the
    rest of SGLang's frontend API this way.

    :param register: ``register(name: str, target: str | object) -> None``.
    :return: nothing.

    Runs in: whichever process first reads such a name.

    .. versionadded:: 0.1
    """
