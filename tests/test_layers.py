"""Imports run one way: no module of the package imports one above it in the layer order the
package docstring writes (numpy_attention/__init__.py), and every module has its place there."""
import ast
import pathlib

import numpy_attention

PACKAGE = pathlib.Path(numpy_attention.__file__).parent


def layer_order():
    """The names of the docstring's layer lines, bottom up, in order: ["numpy_attention", "_checks", ...]."""
    lines = numpy_attention.__doc__.split("Layers, bottom up")[1].split("\n\n")[1].splitlines()
    return [name for line in lines for name in line.split()[1:]]


def module_names():
    """{dotted name inside the package ("" for the package, "oracle.verdicts", ...): path}."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name, path, modules):
    """The package's modules that `name` (at `path`) imports, at any depth of its code."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = [part for part in package if part]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:                             # relative: from the package, level - 1 up
                target = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module == "numpy_attention" or node.module.startswith("numpy_attention."):
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:                   # `from . import scores` imports a module
                module = ".".join(target + [alias.name])
                found.add(module if module in modules else ".".join(target))
        elif isinstance(node, ast.Import):
            found.update(alias.name[len("numpy_attention."):] for alias in node.names
                         if alias.name.startswith("numpy_attention."))
    return found


def place(name, order):
    """The index of the layer name that holds module `name`: itself, else its nearest package."""
    name = name or "numpy_attention"
    while name not in order:
        if "." not in name:
            raise AssertionError(f"{name} has no place in the package docstring's layers")
        name = name.rsplit(".", 1)[0]
    return order.index(name)


def test_every_import_runs_down_the_layers():
    order, modules = layer_order(), module_names()
    assert len(order) == len(set(order)) and {"textbook", "attention", "oracle", "caches"} <= set(order)
    upward = []
    for name, path in sorted(modules.items()):
        here = place(name, order)
        for target in imported(name, path, modules):
            there = place(target, order)
            if there > here:                            # (a subpackage's own imports: the same place)
                upward.append(f"{name or 'numpy_attention'} imports {target or 'numpy_attention'}")
    assert not upward, "imports up the layers: " + "; ".join(upward)


def test_the_walk_sees_what_it_checks():
    """The walk finds known imports, so an empty list of upward ones means something."""
    modules = module_names()
    assert {"caches", "scores", "softmax"} <= imported("textbook", modules["textbook"], modules)
    assert "engines.plan" in imported("oracle.verdicts", modules["oracle.verdicts"], modules)
    assert "scores" in imported("attention", modules["attention"], modules) or \
        "textbook" in imported("attention", modules["attention"], modules)
