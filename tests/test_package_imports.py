"""The package's import: light (no numpy), and the public API as with eager imports.

numpy_attention/__init__.py loads each public name on first use, so that the command gets
control at once (tests/test_cli_outputs.py: Ctrl-C during the imports). `crosscheck` and
`gradcheck` are both subpackages and their functions; na.crosscheck and na.gradcheck are the
functions whichever is imported first. Each case runs in a fresh interpreter: in this one,
everything is imported already.
"""
import subprocess
import sys
import types

import pytest

import numpy_attention as na

HEAVY = ("numpy", "scipy", "ml_dtypes", "threadpoolctl")


def fresh(code):
    """Run `code` in a fresh interpreter; return what it printed (it must not fail)."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_import_loads_no_numpy():
    """`import numpy_attention` imports none of the heavy dependencies (and so fails on an
    __init__ with eager re-exports)."""
    code = (f"import sys, numpy_attention; "
            f"print([name for name in {HEAVY!r} if name in sys.modules])")
    assert fresh(code) == "[]"


@pytest.mark.slow
def test_star_import_and_dir_give_every_public_name():
    """`from numpy_attention import *` binds exactly __all__; dir lists each name, loaded or not."""
    code = ("import numpy_attention as na; names = sorted(dir(na)); "
            "namespace = {}; exec('from numpy_attention import *', namespace); "
            "del namespace['__builtins__']; "
            "print(sorted(namespace) == sorted(na.__all__), set(na.__all__) <= set(names))")
    assert fresh(code) == "True True"


@pytest.mark.parametrize("name", na.__all__)
def test_each_public_name_is_its_modules_object(name):
    """Every name of __all__ resolves, and to the object its defining module holds (no
    subpackage where a function is expected)."""
    value = getattr(na, name)
    assert not isinstance(value, types.ModuleType)
    assert getattr(sys.modules[value.__module__], value.__name__) is value


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'numpy_attention' has no attribute 'nope'"):
        na.nope                                        # noqa: B018
    assert not hasattr(na, "nope")


@pytest.mark.slow
@pytest.mark.parametrize("first", [
    "import numpy_attention",
    "from numpy_attention.oracle.rule import judge",
    "import numpy_attention.finite_differences.verdict_table",
    "from numpy_attention.oracle import crosscheck",
    "from numpy_attention.finite_differences import gradcheck",
    "import numpy_attention.commands.demo",
    "import numpy_attention.commands.crosscheck",
    "from numpy_attention import gradcheck, crosscheck",
])
def test_crosscheck_and_gradcheck_stay_functions_whatever_is_imported_first(first):
    """na.crosscheck, na.gradcheck and na.conform are the functions, and their subpackages,
    named otherwise (oracle, finite_differences, conformance), import as attributes too:
    `import numpy_attention.oracle.rule` gives numpy_attention.oracle.rule."""
    code = (f"{first}\n"
            "import numpy_attention as na, numpy_attention.oracle.rule\n"
            "import numpy_attention.finite_differences.gradient_check, numpy_attention.conformance.run\n"
            "for name, package in (('crosscheck', 'oracle'), ('gradcheck', 'finite_differences'),\n"
            "                      ('conform', 'conformance')):\n"
            "    function, module = getattr(na, name), getattr(na, package)\n"
            "    print(name, type(function).__name__, type(module).__name__, function is module.__dict__[name])\n"
            "print(numpy_attention.oracle.rule.__name__)\n")
    assert fresh(code).splitlines() == ["crosscheck function module True", "gradcheck function module True",
                                        "conform function module True", "numpy_attention.oracle.rule"]


def imports_between_modules(root):
    """{module: the package's modules it imports (at any depth of its code, lazy ones too)}."""
    import ast
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges[name] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                edges[name] |= {m for m in [target] + [f"{target}.{a.name}" for a in node.names] if m in modules}
    return edges


def test_imports_run_one_way():
    """No module imports one that imports it, directly or through others (a package's
    __init__ importing its own submodules aside): layers import down, never up."""
    import pathlib
    edges = imports_between_modules(pathlib.Path(na.__file__).parent)
    related = lambda a, b: a.startswith(b + ".") or b.startswith(a + ".")
    state, path, cycles = {}, [], []
    def visit(module):
        state[module] = "open"
        path.append(module)
        for other in sorted(edges[module]):
            if related(module, other) or other == "numpy_attention":
                continue
            if state.get(other) == "open":
                cycles.append(path[path.index(other):] + [other])
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = "done"
    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert len(edges) > 50 and not cycles, cycles
