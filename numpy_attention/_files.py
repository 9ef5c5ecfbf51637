"""Writing an output file so that a failure part-way never leaves a truncated file behind.

A leaf module. `replacing(path, mode)` opens a temporary file in the target's directory;
when the writing succeeds it is renamed onto `path` (atomic on POSIX: readers see the old
file or the new one, never half of one); when it fails, the temporary file is removed and
`path` is as it was. A path that exists and is not a regular file (a device such as
/dev/null or /dev/full, a pipe, or a link to one) is not replaced, which would put a file
in the device's place and lose what was written: the content is staged in an anonymous
temporary file (writers such as zipfile seek in what they write, which a device does not
keep), then copied to the path.
"""
import contextlib
import os
import shutil
import tempfile


def _umask():
    """The process's umask (read by setting and restoring it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def replacing(path, mode="w"):
    """A file object to write `path`'s new content into ('w' text, 'wb' binary)."""
    text = {} if "b" in mode else {"newline": ""}
    if os.path.exists(path) and not os.path.isfile(path):
        with tempfile.TemporaryFile(mode.replace("w", "w+"), **text) as staged:
            yield staged
            staged.seek(0)
            with open(path, mode, **text) as f:
                shutil.copyfileobj(staged, f)
        return
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".", suffix=".partial")
    try:
        os.chmod(temporary, 0o666 & ~_umask())                 # as open() would have created it
        with os.fdopen(descriptor, mode, **text) as f:
            yield f
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
