"""Every module of the package imports on its own (the quick tier's floor: each is loaded even
where its own tests are left out), and none is left out of this list by accident."""

import importlib
import pkgutil

import pytest

import dense_armor

MODULES = sorted(m.name for m in pkgutil.walk_packages(dense_armor.__path__, prefix="dense_armor."))


def test_the_package_has_its_wings():
    assert len(MODULES) > 60
    assert {"dense_armor.serving.http", "dense_armor.export.standalone", "dense_armor.cli"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports(name):
    module = importlib.import_module(name)
    assert module.__name__ == name
