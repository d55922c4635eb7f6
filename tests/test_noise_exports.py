"""The public namespaces of the channel modules are what we mean them to be."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

from p2pnode.transport import aead, channel, framing, noise, secure


@pytest.mark.parametrize("module", [noise, secure, framing, channel, aead])
def test_all_lists_exactly_the_public_definitions(module: ModuleType) -> None:
    exported = set(module.__all__)
    for name in exported:
        assert hasattr(module, name), name
    defined = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (
            (inspect.isclass(value) or inspect.isfunction(value))
            and value.__module__ == module.__name__
        )
    }
    assert defined <= exported, defined - exported


def test_layering() -> None:
    # Lower layers never import the trio driver.
    for module in (noise, secure, framing, aead):
        assert "trio" not in vars(module)
        assert "channel" not in vars(module)
