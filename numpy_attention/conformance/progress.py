"""The sweep's lines on stderr as it goes: what it will run, each case that does not pass as
it is judged, and a progress bar on a terminal (tqdm's if it is installed, else its own line).

    bar = progress_bar(total, enabled)      # enabled None: iff stderr is a terminal
    bar.say(line)                           # a line, above the bar
    bar.update(failed)                      # one case done; failed: it did not pass
    bar.close()

Enabled off a terminal (a CI log), the lines come without the bar.
"""
import sys
import time

WIDTH = 30                  # the plain bar's cells


def progress_bar(total, enabled=None, stream=None):
    """The lines and bar over `total` cases on `stream` (default sys.stderr): nothing when not
    enabled (by default: when the stream is not a terminal); the lines alone off a terminal."""
    stream = sys.stderr if stream is None else stream
    terminal = stream.isatty()
    if enabled is False or (enabled is None and not terminal):
        return NoBar()
    if not terminal:
        return Lines(stream)
    try:
        from tqdm import tqdm
    except ImportError:
        return LineBar(total, stream)
    return TqdmBar(tqdm(total=total, file=stream, unit="case", desc="conform", leave=False), stream)


class NoBar:
    def say(self, line):
        pass

    def update(self, failed):
        pass

    def close(self):
        pass


class Lines(NoBar):
    """The lines, no bar."""

    def __init__(self, stream):
        self.stream = stream

    def say(self, line):
        self.stream.write(line + "\n")
        self.stream.flush()


class TqdmBar:
    def __init__(self, bar, stream):
        self.bar, self.stream, self.failed = bar, stream, 0

    def say(self, line):
        self.bar.write(line, file=self.stream)

    def update(self, failed):
        self.failed += bool(failed)
        self.bar.set_postfix(failed=self.failed, refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


class LineBar(Lines):
    """conform  37/216 [#####.........................] 2 failed, 12 s (one line, redrawn)."""

    def __init__(self, total, stream):
        super().__init__(stream)
        self.total, self.done, self.failed = total, 0, 0
        self.start = time.monotonic()

    def say(self, line):
        self.stream.write("\r\033[K")           # the bar erased, the line written, the bar again
        super().say(line)
        self._draw()

    def update(self, failed):
        self.done += 1
        self.failed += bool(failed)
        self._draw()

    def _draw(self):
        if self.done:
            filled = WIDTH * self.done // max(self.total, 1)
            self.stream.write(f"\rconform {self.done:>4}/{self.total} [{'#' * filled}{'.' * (WIDTH - filled)}] "
                              f"{self.failed} failed, {time.monotonic() - self.start:.0f} s")
            self.stream.flush()

    def close(self):
        if self.done:
            self.stream.write("\r\033[K")         # the line erased: the report follows on a clean line
            self.stream.flush()
