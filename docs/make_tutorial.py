"""Build docs/tutorial.ipynb from its source docs/tutorial.py, executed, with its outputs.

    python3 docs/make_tutorial.py            # needs the `learn` extra: pip install -e '.[learn]'

The source is a Python script in jupytext's percent format: a line `# %%` starts a code
cell, `# %% [markdown]` a markdown cell whose lines are comments (`# ` stripped). It runs as
a plain script too (`python3 docs/tutorial.py`; figures then go to matplotlib's backend).
The notebook is executed top to bottom in a fresh kernel (nbclient) and stored with its
outputs, so that it reads on GitHub and offline; nothing that changes from run to run is
kept (no timings, no Python version), so the stored file changes only with its source.
tests/test_tutorial.py checks that the stored notebook is this build of its source, and runs
it again in a fresh kernel.
"""
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
SOURCE, NOTEBOOK = DOCS / "tutorial.py", DOCS / "tutorial.ipynb"
MARKDOWN, CODE = "# %% [markdown]", "# %%"
CELL_TIMEOUT = 300          # seconds a cell may run before nbclient gives up (a hang, not a measure)
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def cells(source):
    """[(kind, text)]: the percent-format source cut at its `# %%` lines; kind 'markdown' or
    'code'; a markdown cell's lines lose their leading '# ' (or '#')."""
    found = []
    for line in source.splitlines():
        if line.startswith(CODE):
            found.append(("markdown" if line.startswith(MARKDOWN) else "code", []))
        elif found:
            found[-1][1].append(line)
    result = []
    for kind, lines in found:
        if kind == "markdown":
            lines = [line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines]
        result.append((kind, "\n".join(lines).strip("\n")))
    return result


def notebook(source):
    """The unexecuted nbformat notebook of a percent-format source."""
    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    make = {"markdown": nbformat.v4.new_markdown_cell, "code": nbformat.v4.new_code_cell}
    nb.cells = [make[kind](text) for kind, text in cells(source)]
    for number, cell in enumerate(nb.cells):
        cell.id = f"cell-{number}"                   # stable ids: the file changes with its source only
    return nb


def execute(nb):
    """nb run top to bottom in a fresh kernel, in docs/ (nbclient), without timing metadata; a
    cell's printed text as one output a stream (the kernel may send one print in pieces)."""
    from nbclient import NotebookClient
    NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name=KERNEL["name"], record_timing=False, coalesce_streams=True,
                   extra_arguments=["--IPKernelApp.log_level=ERROR"],     # the kernel's own log: quiet
                   resources={"metadata": {"path": str(DOCS)}}).execute()
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    return nb


def main():
    import nbformat
    nb = execute(notebook(SOURCE.read_text()))
    NOTEBOOK.write_text(nbformat.writes(nb) + "\n")
    print(f"wrote {NOTEBOOK.relative_to(DOCS.parent)}: {len(nb.cells)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
