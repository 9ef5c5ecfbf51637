"""Reading a .npz case from a stranger: everything checked before any data is read.

A case file may be hostile: a path that is not a regular file (a FIFO would block open()
forever), a single .npy posing as a case, members with names the case cannot have, members
encrypted or compressed with a method Python cannot read, a zip bomb declaring gigabytes,
.npy headers whose shapes lie about their size. `read_npz` refuses each with a ValueError
naming the member, in this order, and only then reads the arrays:

    1. the path is a regular file whose first bytes are a zip's
    2. every member is KEY.npy with KEY a case key, not encrypted, compressed by a method
       zipfile reads (stored, deflate, bzip2, lzma)
    3. the members declare at most half this machine's memory in all
    4. each .npy header (read alone) has a plain dtype (no pickled objects) and a shape
       whose size is what the zip directory declares for the member
Reading an array then allocates at most its checked size.
"""
import math
import os
import stat
import zipfile

import numpy as np

READABLE = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA)


def _memory_bytes():
    """This machine's physical memory (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _member_key(info, keys):
    """The case key of a zip member KEY.npy; ValueError for any other member."""
    key = info.filename[:-4] if info.filename.endswith(".npy") else None
    if key not in keys:
        raise ValueError(f"unknown key {key if key is not None else info.filename!r}; a case has "
                         f"keys {', '.join(keys)}")
    if info.flag_bits & 0x1:
        raise ValueError(f"{key} is encrypted")
    if info.compress_type not in READABLE:
        raise ValueError(f"{key} is compressed by zip method {info.compress_type}, which Python "
                         f"cannot read (stored, deflate, bzip2 and lzma can be)")
    return key


def _checked_header(archive, info, key):
    """Read the member's .npy header alone; ValueError unless its size is the declared one."""
    with archive.open(info) as member:
        version = np.lib.format.read_magic(member)
        read = {(1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"{key} has an .npy header of version {version}, not 1.0 or 2.0")
        shape, _, dtype = read(member)
        header_bytes = member.tell()
    if dtype.hasobject:
        raise ValueError(f"{key} holds Python objects (dtype {dtype}); a case holds numbers")
    data_bytes = math.prod(shape) * dtype.itemsize
    if header_bytes + data_bytes != info.file_size:
        raise ValueError(f"{key}'s header says shape {shape} of {dtype} ({data_bytes} bytes), but the "
                         f"archive declares {info.file_size - header_bytes} bytes of data")


def read_npz(path, keys):
    """{key: array} of a .npz case file, checked as the module docstring says (ValueError)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError("not a regular file")
    with open(path, "rb") as f:
        head = f.read(6)
        if head == b"\x93NUMPY":
            raise ValueError("not an .npz archive (a single .npy array)")
        if not head.startswith(b"PK"):
            raise ValueError("not an .npz archive (no zip header)")
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
            members = {_member_key(info, keys): info for info in infos}
            declared, memory = sum(info.file_size for info in infos), _memory_bytes()
            if memory is not None and declared > memory / 2:
                raise ValueError(f"its arrays declare {declared / 2 ** 30:.1f} GiB; this machine has "
                                 f"{memory / 2 ** 30:.1f} GiB, and the oracle needs several times a case's size")
            for key, info in members.items():
                _checked_header(archive, info, key)
            arrays = {}
            for key, info in members.items():
                with archive.open(info) as member:
                    arrays[key] = np.lib.format.read_array(member, allow_pickle=False)
            return arrays
