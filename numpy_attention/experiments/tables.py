"""The study's records as text tables, JSON and CSV; the training curves as text tables.

A record is a flat dict of numbers and bools (see measurements.py); every writer takes a
path or '-' for stdout, and the JSON / CSV columns are the records' keys, in order. The
text tables fit in WIDTH columns: a column that follows from others (the theory's Var S,
log N_k) is said above the table, and a training curve shows at most CURVE_POINTS of its
evaluations.
"""
import contextlib
import csv
import json
import math
import sys
import textwrap

from .._files import replacing

WIDTH = 100
CURVE_POINTS = 8
# (key, header, format) of the printed tables
SWEEP_COLUMNS = (("d_k", "d_k", "{:d}"), ("n_keys", "N_k", "{:d}"), ("scaled", "scaled", "{!s}"),
                 ("logit_var", "Var S", "{:.3g}"), ("entropy", "entropy", "{:.3g}"),
                 ("max_weight", "max p", "{:.3g}"), ("jacobian_norm", "||J||_F", "{:.3g}"),
                 ("grad_norm", "||dq||", "{:.3g}"), ("grad_norm_min", "min", "{:.2g}"),
                 ("complex_step_err", "err CS", "{:.1e}"), ("central_diff_err", "err CD", "{:.1e}"))
ALPHA_COLUMNS = ((("alpha", "alpha", "{:.2f}"), ("scale", "scale", "{:.3g}")) + SWEEP_COLUMNS[1:2]
                 + SWEEP_COLUMNS[3:])                     # d_k is one, in the heading; no `scaled`


def format_table(records, columns=SWEEP_COLUMNS):
    """Right-aligned rows, one per record, two spaces apart; each column as wide as its widest
    cell or header."""
    rows = [[fmt.format(r[key]) for key, _, fmt in columns] for r in records]
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, (_, header, _) in enumerate(columns)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line([h for _, h, _ in columns])] + [line(row) for row in rows])


def sweep_legend(n_keys):
    """What the sweep table leaves out: the theory's Var S and the entropy's bound, log N_k."""
    bounds = ", ".join(f"{math.log(n):.3g} ({n} keys)" for n in n_keys)
    return textwrap.fill(f"theory: Var S = d_k unscaled, 1 scaled; entropy <= log N_k: {bounds}", WIDTH)


def format_curves(curves):
    """The held-out loss of each training.Curve at the same evaluations, one row per curve:
    step 0, the first evaluation after it, then every k-th to the last, at most CURVE_POINTS
    in all (--plot draws every one)."""
    n = len(curves[0].steps)
    stride = max(1, math.ceil((n - 1) / (CURVE_POINTS - 2)))
    shown = range(n) if n <= CURVE_POINTS else sorted({0, 1, n - 1, *range(stride, n, stride)})
    rows = [["scale", "lr"] + [str(curves[0].steps[i]) for i in shown]]
    rows += [[_scale(c), f"{c.lr:g}"] + [f"{c.loss[i]:.3g}" for i in shown] for c in curves]
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    widths[2:] = [max(widths[2:])] * len(shown)                       # the losses in equal columns
    line = lambda row: "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])
    return "\n".join(["held-out loss after each number of steps"] + [line(row) for row in rows])


def format_outcomes(curves, vanished):
    """Each curve's final loss, accuracy and share of vanished steps (||dW|| < `vanished`)."""
    lines = [f"{'scale':<10}{'lr':>8}{'final loss':>12}{'accuracy':>10}{'vanished steps':>16}"]
    lines += [f"{_scale(c):<11}{c.lr:>7g}{c.loss[-1]:>12.3g}{c.accuracy[-1]:>10.2f}{c.vanished:>16.0%}"
              for c in curves]
    return "\n".join(lines + [f"(vanished: the step's ||dW|| < {vanished:g})"])


def _scale(curve):
    return "1/sqrt(d_k)" if curve.scaled else "unscaled"


@contextlib.contextmanager
def _output(path):
    """A text file opened for writing (replaced only once written whole), or sys.stdout
    (left open) for '-'."""
    if path == "-":
        yield sys.stdout
    else:
        with replacing(path, "w") as f:
            yield f


def write_json(records, path):
    """A JSON list of the records (path '-' for stdout)."""
    with _output(path) as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def write_csv(records, path):
    """CSV with the records' keys as columns (path '-' for stdout)."""
    with _output(path) as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
