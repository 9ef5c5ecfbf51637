"""crosscheck on files from strangers: every hostile file is refused with one line and exit 2,
before its data is read (peak memory under 200 MiB; the time: benchmarks/bench_refusals.py)."""
import io
import json
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest


def _npz(members, compression=zipfile.ZIP_STORED):
    """A .npz of name -> bytes (the .npy members as written), as bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return bytearray(buffer.getvalue())


def _npy(x):
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, x)
    return buffer.getvalue()


def _patch_directory(data, offset_in_entry, fmt, value):
    """Overwrite a field of every central-directory entry (signature PK\\1\\2)."""
    start = 0
    while (start := data.find(b"PK\x01\x02", start)) >= 0:
        struct.pack_into(fmt, data, start + offset_in_entry, value)
        start += 4
    return data


def _plain():
    return {f"{name}.npy": _npy(np.ones((1, 2, 3))) for name in ("q", "k", "v", "out")}


def _hostile(kind, tmp_path):
    path = tmp_path / f"{kind}.npz"
    if kind == "zip bomb (declared)":                      # q declares 1 TiB uncompressed
        data = _patch_directory(_npz(_plain()), 24, "<I", 0xFFFFFFFF)
    elif kind == "encrypted member":
        data = _patch_directory(_npz(_plain()), 8, "<H", 0x1)
    elif kind == "unknown compression":
        data = _patch_directory(_npz(_plain()), 10, "<H", 99)
    elif kind == "huge declared shape":                    # the header claims 10^12 floats
        header = _npy(np.ones(3))
        data = _npz({**_plain(), "q.npy": header.replace(b"(3,)", b"(1000000000000,)")})
    elif kind == "unknown key of 200 MiB":
        data = _npz({**_plain(), "x.npy": _npy(np.zeros(25 * 2 ** 20))}, zipfile.ZIP_DEFLATED)
    elif kind == "a single .npy":
        data = _npy(np.zeros(10))
    elif kind == "object array":
        data = _npz({**_plain(), "q.npy": _npy(np.array([{"a": 1}], dtype=object))})
    elif kind == "a FIFO":
        os.mkfifo(path)
        return path
    elif kind == "a directory":
        path.mkdir()
        return path
    path.write_bytes(bytes(data))
    return path


KINDS = ["zip bomb (declared)", "encrypted member", "unknown compression", "huge declared shape",
         "unknown key of 200 MiB", "a single .npy", "object array", "a FIFO", "a directory"]
# the declared bomb: beyond this machine's memory, or (with more memory) beyond its header's size
MESSAGES = {"zip bomb (declared)": "declare", "encrypted member": "is encrypted",
            "unknown compression": "zip method 99", "huge declared shape": "header says shape (1000000000000,)",
            "unknown key of 200 MiB": "unknown key 'x'", "a single .npy": "a single .npy array",
            "object array": "holds Python objects", "a FIFO": "not a regular file",
            "a directory": "not a regular file"}

CHILD = """
import contextlib, io, json, sys
from numpy_attention.commands.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(["crosscheck", sys.argv[1]])
peak = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
print(json.dumps({"code": code, "err": err.getvalue(), "peak_mib": peak}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_file_is_refused_in_little_memory(kind, tmp_path):
    """Refused with one line before any of its declared data is held: the child's peak stays
    far below what reading it would take (a bomb's, or the 200 MiB member's); a child that
    hangs on it (a FIFO read) fails the timeout."""
    path = _hostile(kind, tmp_path)
    result = json.loads(subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True,
                                       text=True, timeout=60, check=True).stdout)
    assert result["code"] == 2 and result["err"].count("\n") == 1, result
    assert MESSAGES[kind] in result["err"], result["err"]
    assert result["peak_mib"] < 200, result
