"""`numpy-attention vanishing`: the 1/sqrt(d_k) study (numpy_attention.experiments) on the command line.

    numpy-attention vanishing [--d-k 1,4,...] [--n-keys 8,128] [--trials N] [--seed S]
                              [--alpha-d-k D] [--json PATH|-] [--csv PATH|-] [--plot PATH.png]
    numpy-attention vanishing --train [--optimizer sgd|adam] [--steps N] [--lr 0.01,0.1] [--plot PATH.png]

Prints the sweep table and the scale = d_k^-alpha table (unless --json or --csv writes to
stdout); --json / --csv hold the sweep's records. Progress goes to stderr once a run has
taken more than a second, then one line every few seconds at most (the training counts its
steps). An option of the other mode (--json with --train, --lr without it) is bad input, as
are sizes beyond SIZE_MAX and output paths that cannot be written, checked before the work
starts.
"""
import argparse
import math
import os
import sys
import time

import numpy as np

from ..experiments import measurements, plot, tables, training
from .cli import UsageError, integer

SIZE_MAX = 2 ** 31 - 1                   # d_k, n_keys, trials: sizes of array axes
PROGRESS_AFTER, PROGRESS_EVERY = 1.0, 5.0     # seconds: the first progress line, then at most one per
# each mode's options and their defaults (the parser's default is None: "not given")
SWEEP_OPTIONS = {"d_k": measurements.DEFAULT_D_K, "n_keys": measurements.DEFAULT_N_KEYS,
                 "trials": measurements.DEFAULT_TRIALS, "alpha_d_k": 256, "json": None, "csv": None}
TRAINING_OPTIONS = {"optimizer": "sgd", "steps": 300, "lr": training.LEARNING_RATES}
HELP = "the 1/sqrt(d_k) vanishing-gradient study"
DESCRIPTION = """\
The 1/sqrt(d_k) vanishing-gradient study: a sweep over d_k and N_k (default), or
a retrieval task trained scaled vs unscaled (--train). Exit codes: 0 done,
2 bad arguments or an output that cannot be written."""


def _list(kind):
    """An argparse type: a comma-separated list of finite `kind` values > 0, e.g. '16,64'
    (integers at most SIZE_MAX)."""
    def parse(text):
        try:
            values = tuple(kind(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list of "
                                             f"{'integers' if kind is int else 'numbers'}, got {text!r}") from None
        if not all(math.isfinite(x) and x > 0 for x in values):
            raise argparse.ArgumentTypeError(f"values must be finite and > 0, got {text!r}")
        if kind is int and max(values) > SIZE_MAX:
            raise argparse.ArgumentTypeError(f"values must be at most {SIZE_MAX}, got {text!r}")
        return values
    return parse


def _listed(values):
    return ",".join(f"{x:g}" for x in values)


def add_arguments(parser):
    parser.add_argument("--d-k", type=_list(int),
                        help=f"key widths to sweep (default {_listed(SWEEP_OPTIONS['d_k'])})")
    parser.add_argument("--n-keys", type=_list(int),
                        help=f"numbers of keys to sweep (default {_listed(SWEEP_OPTIONS['n_keys'])})")
    parser.add_argument("--trials", type=integer(1, SIZE_MAX),
                        help=f"samples per cell (default {SWEEP_OPTIONS['trials']})")
    parser.add_argument("--seed", type=integer(0), default=0,
                        help="seed of every sample, and of the training data and initialization (default 0)")
    parser.add_argument("--alpha-d-k", type=integer(1, SIZE_MAX),
                        help=f"d_k of the scale = d_k^-alpha table (default {SWEEP_OPTIONS['alpha_d_k']})")
    parser.add_argument("--json", metavar="PATH", help="write the sweep's records as JSON ('-': stdout)")
    parser.add_argument("--csv", metavar="PATH", help="write the sweep's records as CSV ('-': stdout)")
    parser.add_argument("--plot", metavar="PATH.png",
                        help="save the figure of the sweep (of the training curves with --train), PNG "
                             "or the format of its extension (needs matplotlib)")
    parser.add_argument("--train", action="store_true",
                        help="run the training demo instead of the sweep")
    parser.add_argument("--optimizer", choices=training.OPTIMIZERS,
                        help=f"training demo optimizer: sgd (with momentum) or adam "
                             f"(default {TRAINING_OPTIONS['optimizer']})")
    parser.add_argument("--steps", type=integer(1, SIZE_MAX),
                        help=f"training demo steps (default {TRAINING_OPTIONS['steps']})")
    parser.add_argument("--lr", type=_list(float),
                        help=f"training demo learning rates (default {_listed(TRAINING_OPTIONS['lr'])})")


def _progress(what, unit=""):
    """A progress callback, (done, total, *where): a line on stderr once the run has taken more
    than PROGRESS_AFTER seconds (a short run prints none), then at most one every PROGRESS_EVERY
    seconds; where, if given, is the sweep's (d_k, n_keys)."""
    start, last = time.monotonic(), None

    def report_progress(done, total, *where):
        nonlocal last
        now = time.monotonic()
        if now - start > PROGRESS_AFTER and (last is None or now - last >= PROGRESS_EVERY):
            last = now
            at = f" (d_k={where[0]}, n_keys={where[1]})" if where else ""
            print(f"{what}: {done}/{total}{unit}{at}, {now - start:.0f} s", file=sys.stderr)
    return report_progress


def _save(function, data, path, option):
    """function(data, path), a file writer; a path it cannot write is bad input (exit 2)."""
    try:
        function(data, path)
    except OSError as exc:
        raise UsageError(f"{option}: cannot write {path!r}: {exc.strerror or exc}") from None
    if path != "-":
        print(f"{option}: wrote {path}", file=sys.stderr)


def _require_memory(n_keys, trials):
    """UsageError before the work when the sweep would need more than half this machine's memory."""
    need = max(measurements.peak_bytes(n, trials) for n in n_keys)
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):      # not a POSIX system: no bound to check
        return
    if need > have / 2:
        raise UsageError(f"--trials {trials} with {max(n_keys)} keys needs about {need / 2 ** 30:.1f} GiB "
                         f"for the per-trial results; this machine has {have / 2 ** 30:.1f} GiB: "
                         f"lower --trials or --n-keys")


def run_sweep(args):
    _require_memory(args.n_keys, args.trials)
    records = measurements.sweep(args.d_k, args.n_keys, args.trials, args.seed, _progress("sweep"))
    alphas = measurements.scale_sweep(args.alpha_d_k, args.n_keys, trials=args.trials, seed=args.seed)
    if "-" not in (args.json, args.csv):
        print(f"float64, {args.trials} trials per cell, seed {args.seed}; medians over trials, "
              f"Var S pooled, err = max over trials")
        print(f"{tables.sweep_legend(args.n_keys)}\n")
        print(tables.format_table(records))
        print(f"\nscale = d_k^-alpha at d_k = {args.alpha_d_k} (0.5 keeps Var S = 1; in theory "
              f"Var S = scale^2 d_k)\n")
        print(tables.format_table(alphas, tables.ALPHA_COLUMNS))
    if args.json is not None:
        _save(tables.write_json, records, args.json, "--json")
    if args.csv is not None:
        _save(tables.write_csv, records, args.csv, "--csv")
    if args.plot is not None:
        _save(plot.plot_sweep, records, args.plot, "--plot")
    return 0


def run_training(args):
    task = training.Task()
    with np.errstate(over="ignore", invalid="ignore"):    # a diverging lr shows as inf / nan losses
        curves = training.compare(task, lrs=args.lr, optimizer=args.optimizer, steps=args.steps,
                                  seed=args.seed, progress=_progress("training", " steps"))
    print(f"retrieval task {task}, optimizer {args.optimizer}, seed {args.seed}")
    print(tables.format_curves(curves))
    print(f"\n{tables.format_outcomes(curves, training.VANISHED)}")
    if args.plot is not None:
        _save(plot.plot_training, curves, args.plot, "--plot")
    return 0


def _where(path):
    """Where an output goes: stdout for '-', else the file's absolute path."""
    return "stdout" if path == "-" else os.path.realpath(path)


def _check_output(path, option):
    """UsageError now, before the work, for an output path that cannot be written."""
    if path == "-":
        if option == "--plot":
            raise UsageError("--plot: a figure needs a file path ('-', stdout, is for --json and --csv)")
        return
    folder = os.path.dirname(path) or "."
    why = ("empty path" if not path else
           "it is a directory" if os.path.isdir(path) else
           "no such writable directory" if not (os.path.isdir(folder) and os.access(folder, os.W_OK)) else
           None)
    if why:
        raise UsageError(f"{option}: cannot write {path!r}: {why}")


def _options(args):
    """A copy of args with the mode's defaults filled in; UsageError for an option of the other mode."""
    mine, theirs = (TRAINING_OPTIONS, SWEEP_OPTIONS) if args.train else (SWEEP_OPTIONS, TRAINING_OPTIONS)
    for name in theirs:
        if getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} "
                             + ("belongs to the sweep, not to --train" if args.train else "needs --train"))
    filled = {name: default for name, default in mine.items() if getattr(args, name) is None}
    return argparse.Namespace(**{**vars(args), **filled})


def run(args):
    args = _options(args)
    outputs = [(option, path) for option, path in (("--json", args.json), ("--csv", args.csv),
                                                   ("--plot", args.plot)) if path is not None]
    for option, path in outputs:                           # before the work, not after it
        _check_output(path, option)
    destinations = [_where(path) for _, path in outputs]
    clash = next((place for place in destinations if destinations.count(place) > 1), None)
    if clash:
        raise UsageError(f"{' and '.join(option for option, path in outputs if _where(path) == clash)} "
                         f"name the same output ({clash})")
    if args.plot is not None:
        try:
            plot.check_path(args.plot)
        except (ImportError, ValueError) as exc:
            raise UsageError(f"--plot: {exc}") from None
    return run_training(args) if args.train else run_sweep(args)
