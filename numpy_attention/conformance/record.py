"""The run's record, written as it goes: out_dir/conform.jsonl, one JSON object a line.

    {"kernel": ..., "seed": ..., "grid_cases": ...}     the settings, written before the sweep
    {"id": ..., "status": "PASS", ...}                  each case, flushed as it is judged
                                                        (report.case_json)
    {"id": ..., "property": ..., "status": ...}         each property trial, as it is run
                                                        (report.trial_json)

Opening it before the sweep is the check that out_dir can be written: a path that is not a
directory, or a full or read-only device, is an OSError naming the path before any kernel
runs. A run that dies (killed, out of memory) leaves every case judged before. A write that
fails later (the device filled up) is remembered, once, in `unsaved`, and the record stops:
the run's report is still printed.
"""
import errno
import json
import os

NAME = "conform.jsonl"


class Record:
    """The record in out_dir (None: no record, nothing written)."""

    def __init__(self, out_dir, settings):
        self.file, self.unsaved = None, ""
        if out_dir is None:
            return
        self.path = os.path.join(os.fspath(out_dir), NAME)
        try:
            if os.path.exists(out_dir) and not os.path.isdir(out_dir):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", os.fspath(out_dir))
            os.makedirs(out_dir, exist_ok=True)
            self.file = open(self.path, "w", encoding="utf-8")
            self._write(settings)
        except OSError as exc:                # named by its path, whatever call failed
            self.close()
            raise OSError(exc.errno, exc.strerror, exc.filename or self.path) from None

    def add(self, case):
        """Write one case's JSON object (report.case_json) and flush it."""
        if self.file is None:
            return
        try:
            self._write(case)
        except OSError as exc:
            self.failed(self.path, exc)
            self.close()

    def failed(self, path, exc):
        """Remember the first file of the run that could not be written (path: why)."""
        self.unsaved = self.unsaved or f"{path}: {exc.strerror or exc}"

    def _write(self, value):
        self.file.write(json.dumps(value) + "\n")
        self.file.flush()

    def close(self):
        if self.file is not None:
            try:
                self.file.close()
            except OSError:                   # what was left to write: it failed already
                pass
            self.file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
