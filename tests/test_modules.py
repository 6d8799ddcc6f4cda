"""Every module of the package imports on its own (the quick tier's floor: each is loaded even
where its own tests are left out), and none is left out of this list by accident; and the house
keeps its shape: wings at the top, short functions."""

import ast
import importlib
import pathlib
import pkgutil

import pytest

import dense_armor

MODULES = sorted(m.name for m in pkgutil.walk_packages(dense_armor.__path__, prefix="dense_armor."))


def test_the_package_has_its_wings():
    assert len(MODULES) > 60
    assert {"dense_armor.serving.http", "dense_armor.export.standalone", "dense_armor.cli"} <= set(
        MODULES
    )


PACKAGE = pathlib.Path(dense_armor.__file__).parent
LONGEST = 60  # lines of a function, its signature and docstring included


def test_the_top_level_is_wings_and_at_most_six_modules_beside_them():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    wings = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert len(modules) <= 6, modules
    assert {"nn", "checkpoints", "training", "cli", "export", "serving"} <= set(wings), wings


def test_no_function_passes_sixty_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} {lines}")
    assert not long, long


@pytest.mark.parametrize("name", MODULES)
def test_each_module_imports(name):
    module = importlib.import_module(name)
    assert module.__name__ == name
