"""The README's Python examples run as written, and its commands are the ones CI runs."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_top_commands_and_ci_agree():
    first_block = re.search(r"```bash\n(.*?)```", README, flags=re.S).group(1).splitlines()
    assert "numpy-attention demo" in first_block[0]
    test_command = first_block[1].split("&&")[-1].strip()
    assert test_command == "python3 -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines()
