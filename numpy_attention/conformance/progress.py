"""The sweep's progress bar on stderr: tqdm's if it is installed, else one line of its own.

    bar = progress_bar(total, enabled)      # enabled None: a bar iff stderr is a terminal
    bar.update(failed)                      # one case done; failed: it did not pass
    bar.close()
"""
import sys
import time

WIDTH = 30                  # the plain bar's cells


def progress_bar(total, enabled=None, stream=None):
    """A bar over `total` cases on `stream` (default sys.stderr); none (a bar that prints
    nothing) when not enabled, and by default when the stream is not a terminal."""
    stream = sys.stderr if stream is None else stream
    if enabled is None:
        enabled = stream.isatty()
    if not enabled:
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return LineBar(total, stream)
    return TqdmBar(tqdm(total=total, file=stream, unit="case", desc="conform", leave=False))


class NoBar:
    def update(self, failed):
        pass

    def close(self):
        pass


class TqdmBar:
    def __init__(self, bar):
        self.bar, self.failed = bar, 0

    def update(self, failed):
        self.failed += bool(failed)
        self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


class LineBar:
    """conform  37/216 [#####.........................] 2 failed, 12 s (one line, redrawn)."""

    def __init__(self, total, stream):
        self.total, self.stream = total, stream
        self.done = self.failed = 0
        self.start = time.monotonic()

    def update(self, failed):
        self.done += 1
        self.failed += bool(failed)
        filled = WIDTH * self.done // max(self.total, 1)
        self.stream.write(f"\rconform {self.done:>4}/{self.total} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                          f"{self.failed} failed, {time.monotonic() - self.start:.0f} s")
        self.stream.flush()

    def close(self):
        if self.done:
            self.stream.write("\r\033[K")         # the line erased: the report follows on a clean line
            self.stream.flush()
