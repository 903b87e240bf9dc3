"""Every name `shardtrain` exports resolves (they are imported lazily, so a moved one fails only when used)."""

import importlib

import pytest

import shardtrain


@pytest.mark.parametrize("name", shardtrain.__all__)
def test_exported_name_resolves(name):
    value = getattr(importlib.reload(shardtrain), name)
    assert value is not None
    if name.endswith("Error"):
        assert issubclass(value, shardtrain.UserError)
