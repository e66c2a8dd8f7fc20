from __future__ import annotations

import pytest

from sgl.registry import DuplicateRegistrationError, Registry, UnknownNameError


def test_register_and_load_lazily() -> None:
    reg: Registry[object] = Registry("attention backend")
    reg.register("mine", "collections:OrderedDict", owner="plugin-a")
    import collections

    assert reg.load("mine") is collections.OrderedDict
    assert reg.entry("mine").owner == "plugin-a"
    assert reg.names() == ["mine"]


def test_duplicate_names_both_plugins() -> None:
    reg: Registry[object] = Registry("attention backend")
    reg.register("torch", "a:B", owner="plugin-a")
    with pytest.raises(DuplicateRegistrationError) as err:
        reg.register("torch", "c:D", owner="plugin-b")
    assert "plugin-a" in str(err.value) and "plugin-b" in str(err.value)


def test_unknown_name_lists_available() -> None:
    reg: Registry[object] = Registry("grammar backend")
    reg.register("xgrammar", "a:B", owner="p")
    with pytest.raises(UnknownNameError, match="available: xgrammar"):
        reg.load("outlines")


@pytest.mark.parametrize("name,target", [("", "a:b"), ("bad name", "a:b"), ("ok", "no_colon")])
def test_bad_registrations_rejected(name: str, target: str) -> None:
    with pytest.raises(ValueError, match="plugin 'p'"):
        Registry("x").register(name, target, owner="p")
