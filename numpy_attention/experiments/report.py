"""The study's records as a text table, JSON and CSV.

A record is a flat dict of numbers and bools (see vanishing.py); every writer takes a
path or '-' for stdout, and the JSON / CSV columns are the records' keys, in order.
"""
import contextlib
import csv
import json
import sys

from .._files import replacing

# (key, header, format) of the printed table
SWEEP_COLUMNS = (("d_k", "d_k", "{:>6d}"), ("n_keys", "n_keys", "{:>6d}"),
                 ("scaled", "scaled", "{!s:>7}"), ("logit_var", "Var S", "{:>9.3g}"),
                 ("logit_var_theory", "theory", "{:>8.4g}"), ("entropy", "entropy", "{:>9.3g}"),
                 ("log_n_keys", "log N_k", "{:>8.3g}"), ("max_weight", "max p", "{:>7.3g}"),
                 ("jacobian_norm", "||J||_F", "{:>9.3g}"), ("grad_norm", "||dq||", "{:>9.3g}"),
                 ("grad_norm_min", "min", "{:>9.2g}"), ("complex_step_err", "err CS", "{:>9.1e}"),
                 ("central_diff_err", "err CD", "{:>9.1e}"))
ALPHA_COLUMNS = (("alpha", "alpha", "{:>6.2f}"), ("scale", "scale", "{:>9.3g}")) + tuple(c for c in SWEEP_COLUMNS if c[0] != "scaled")


def format_table(records, columns=SWEEP_COLUMNS):
    """Right-aligned rows, one per record; widths follow each column's format."""
    rows = [[fmt.format(r[key]) for key, _, fmt in columns] for r in records]
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, (_, header, _) in enumerate(columns)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line([h for _, h, _ in columns])] + [line(row) for row in rows])


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
