"""docs/tutorial.ipynb: the build of its source docs/tutorial.py, and it runs top to bottom in a
fresh kernel with no warning, printing exactly what it stores (it is seeded); every figure has
labelled axes and a legend (or a labelled colour bar)."""
import importlib.util
import json
import os
import pathlib
import sys

import pytest
from optional import LEARN_REASON

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import make_tutorial  # noqa: E402  (docs/make_tutorial.py: the build)

STORED = json.loads(make_tutorial.NOTEBOOK.read_text())
OPEN_COMMAND = "jupyter lab docs/tutorial.ipynb"          # README's way to open it (the `learn` extra)
learn = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in
                               ("nbformat", "nbclient", "ipykernel", "matplotlib")), reason=LEARN_REASON)

# Run in the notebook's kernel around its own cells: pyplot's show() notes each figure's labels
# before the inline backend draws and closes it; the last cell prints what it noted.
INSPECT = """
import json as _json, matplotlib.pyplot as _plt
_figures, _show = [], _plt.show
def _noting_show(*args, **kwargs):
    for number in _plt.get_fignums():
        figure = _plt.figure(number)
        _figures.append({"legends": len(figure.legends) + sum(ax.get_legend() is not None for ax in figure.axes),
                         "axes": [{"x": ax.get_xlabel(), "y": ax.get_ylabel(), "colorbar": hasattr(ax, "_colorbar")}
                                  for ax in figure.axes]})
    return _show(*args, **kwargs)
_plt.show = _noting_show
"""


def texts(cell):
    """A code cell's printed text and its outputs' kinds, in order."""
    found = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            found.append((output["name"], "".join(output["text"])))
        elif output["output_type"] in ("display_data", "execute_result"):
            found.append((output["output_type"], "".join(output["data"].get("text/plain", "")),
                          sorted(output["data"])))
        else:
            found.append((output["output_type"], output.get("ename"), output.get("evalue")))
    return found


def source(cell):
    return "".join(cell["source"])


def test_the_notebook_is_the_build_of_its_source():
    built = make_tutorial.cells(make_tutorial.SOURCE.read_text())
    assert [(c["cell_type"], source(c)) for c in STORED["cells"]] == built
    assert len(built) >= 40 and {kind for kind, _ in built} == {"markdown", "code"}
    assert STORED["metadata"] == {"kernelspec": make_tutorial.KERNEL, "language_info": {"name": "python"}}
    assert all("execution" not in c.get("metadata", {}) for c in STORED["cells"])   # no timings kept


def test_the_percent_format_is_read_as_jupytext_writes_it():
    text = "import x\n# %% [markdown]\n# # Title\n# a line\n#\n# %%\nprint(1)\n\n\n# %%\ny = 2\n"
    assert make_tutorial.cells(text) == [("markdown", "# Title\na line"), ("code", "print(1)"),
                                         ("code", "y = 2")]


def test_the_notebook_stores_its_outputs_and_explains_the_formulas():
    code = [c for c in STORED["cells"] if c["cell_type"] == "code"]
    assert sum(bool(c["outputs"]) for c in code) >= 20, "the notebook is stored with its outputs"
    text = " ".join(source(c) for c in STORED["cells"] if c["cell_type"] == "markdown")
    for formula in (r"Q = XW^Q", r"\frac{QK^\top}{\sqrt{d_k}}", r"\mathrm{softmax}", r"\text{Output} = SV",
                    r"\text{MultiHead}", r"\mathrm{diag}(p) - pp^\top", r"\mathrm{rowsum}(P \odot dP)",
                    r"\mathrm{Var}(q \cdot k) = d_k", "complex step", "not monotone"):
        assert formula in text, formula
    for module in ("linear.py", "softmax.py", "heads.py", "textbook.py", "multihead.py"):
        assert module in text, module
    images = sum("image/png" in o.get("data", {}) for c in code for o in c["outputs"])
    assert images == 3


@pytest.mark.slow
@learn
def test_a_fresh_kernel_runs_it_and_prints_what_it_stores():
    import matplotlib.pyplot  # noqa: F401  (a first import may build matplotlib's font cache, and say so)
    import nbformat
    nb = nbformat.reads(make_tutorial.NOTEBOOK.read_text(), as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.insert(0, nbformat.v4.new_code_cell(INSPECT))
    nb.cells.append(nbformat.v4.new_code_cell("print(_json.dumps(_figures))"))
    ran = make_tutorial.execute(nb)
    figures = json.loads(ran.cells[-1].outputs[0]["text"])
    ran.cells = ran.cells[1:-1]
    stored = [c for c in STORED["cells"] if c["cell_type"] == "code"]
    fresh = [c for c in ran.cells if c.cell_type == "code"]
    for before, after in zip(stored, fresh):
        assert texts(after) == texts(before), source(before)
        assert not [o for o in after.outputs if o.get("name") == "stderr" or o.output_type == "error"]
    assert len(figures) == 3
    for figure in figures:
        plots = [ax for ax in figure["axes"] if not ax["colorbar"]]
        assert plots and all(ax["x"] and ax["y"] for ax in plots), figure
        assert figure["legends"] or any(ax["colorbar"] and (ax["x"] or ax["y"]) for ax in figure["axes"]), figure


def test_the_readme_says_how_to_open_it_and_the_learn_extra_installs_that():
    """README: `jupyter lab docs/tutorial.ipynb`; setup.cfg's extra `learn` has JupyterLab."""
    import configparser
    assert f"`{OPEN_COMMAND}`" in (ROOT / "README.md").read_text()
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    learn = config["options.extras_require"]["learn"].split()
    assert any(requirement.startswith("jupyterlab") for requirement in learn), learn


def get(port, path, token):
    """The body of GET http://127.0.0.1:port/path from the Jupyter server, authenticated by token."""
    from urllib.request import Request, urlopen
    with urlopen(Request(f"http://127.0.0.1:{port}/{path}", headers={"Authorization": f"token {token}"}),
                 timeout=30) as answer:
        return answer.read()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason=LEARN_REASON)
def test_jupyter_lab_opens_it_and_starts_its_kernel(tmp_path):
    """The README's command, headless (no browser, a free port, a token): the server, serving the
    notebook's folder docs/, gives the stored notebook and the lab page of it, and starts the
    notebook's kernel for it."""
    import socket
    import subprocess
    import time
    from urllib.request import Request, urlopen
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    token = "tutorial-test"
    command = [sys.executable, "-m", "jupyterlab", *OPEN_COMMAND.split()[2:], "--no-browser",
               f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:                 # as root (CI), Jupyter asks for this
        command.append("--allow-root")
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path)}        # its connection files here
    with open(tmp_path / "server.log", "w") as log, \
            subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env) as server:
        try:
            for _ in range(240):                             # up to a minute to start
                try:
                    get(port, "api/status", token)
                    break
                except OSError:
                    assert server.poll() is None, (tmp_path / "server.log").read_text()
                    time.sleep(0.25)
            notebook = json.loads(get(port, "api/contents/tutorial.ipynb", token))["content"]
            assert [source(c) for c in notebook["cells"]] == [source(c) for c in STORED["cells"]]
            assert b"JupyterLab" in get(port, "lab/tree/tutorial.ipynb", token)
            body = json.dumps({"path": "tutorial.ipynb", "type": "notebook",
                               "kernel": {"name": STORED["metadata"]["kernelspec"]["name"]}}).encode()
            request = Request(f"http://127.0.0.1:{port}/api/sessions", data=body, method="POST",
                              headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
            with urlopen(request, timeout=60) as answer:
                kernel = json.loads(answer.read())["kernel"]
            assert kernel["name"] == "python3"
            assert json.loads(get(port, f"api/kernels/{kernel['id']}", token))["execution_state"] != "dead"
        finally:
            server.terminate()
            server.wait(timeout=60)


def test_the_exercise_cells_are_skeletons_that_check_reports_as_not_written():
    code = [source(c) for c in STORED["cells"] if c["cell_type"] == "code"]
    outputs = "".join(t[1] for c in STORED["cells"] if c["cell_type"] == "code" for t in texts(c))
    for name in ("linear_backward", "softmax_backward", "attention_backward", "split_heads",
                 "merge_heads", "multihead_backward"):
        assert any(f"def {name}(" in c and "raise NotImplementedError" in c and
                   f'exercises.check("{name}", {name})' in c for c in code), name
        assert f"{name}: not yet: not written yet" in outputs


def test_the_data_flow_diagram_is_its_scripts_and_names_real_functions():
    """docs/dataflow.svg is what docs/make_diagram.py draws (rerun it after a change), well-formed
    SVG, and each `module.py: function` on it is defined in that module of the package."""
    import re
    import xml.etree.ElementTree as ElementTree
    import make_diagram
    stored = make_diagram.OUT.read_text()
    assert stored == make_diagram.svg()
    root = ElementTree.fromstring(stored)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    refs = re.findall(r"(\w+\.py): (\w+)", stored)
    assert len(refs) == len(make_diagram.FORWARD_STEPS) + len(make_diagram.BACKWARD_STEPS)
    for module, name in refs:
        text = (ROOT / "numpy_attention" / module).read_text()
        assert re.search(rf"^def {name}\b", text, flags=re.M), (module, name)
    for name, shape in make_diagram.FORWARD + make_diagram.BACKWARD:
        assert name in stored and shape.replace("<", "&lt;") in stored
