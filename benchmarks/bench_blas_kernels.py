"""crosscheck's verdicts under other BLAS kernels and thread counts: the same cases judged
under each OpenBLAS kernel this processor runs, on 1 or 2 BLAS threads, by 1 or 2 workers.

    python3 benchmarks/bench_blas_kernels.py [--coretypes Haswell Zen Sandybridge ...] [--no-large]

crosscheck's oracle and baselines multiply with numpy's BLAS (OpenBLAS), whose kernel OpenBLAS
picks for the processor when it loads (threadpoolctl's threadpool_info names it: its
"architecture"), unless the environment variable OPENBLAS_CORETYPE names another. Another
kernel, or another thread count, may sum a product in another order: the printed figures may
move by roundings, the verdicts must not.

Kernels: each name of --coretypes is tried in a child process with OPENBLAS_CORETYPE set, which
multiplies two matrices and says which kernel threadpool_info reports: a kernel the processor
lacks the instructions for dies (illegal instruction, SIGILL), a name this build or this
processor does not take loads another kernel (both are listed). Configurations: the default
(OPENBLAS_CORETYPE unset), and one name for each other kernel that loads, each with
OPENBLAS_NUM_THREADS 1 and 2 and crosscheck's workers 1 and 2.

Cases, made once here and saved as .npz (save_case): in float32, bfloat16 and float16, small
([2, 4, 96, 32] queries on 80 keys) plain, causal, with a keep-mask, and with a bias on grouped
kv heads (4 query heads on 2) and causal; and one large bfloat16 causal case [1, 8, 2048, 64]
on 2048 keys (2^25 scores: crosscheck's blocks of query rows), left out by --no-large.
Candidates: honest ones, which must PASS: "ours" our float64 attention (out, lse, dq, dk, dv,
dbias) rounded to the precision, and "torch" torch's SDPA math backend run in the precision
(where torch is installed; tests/real_kernels.py's runner); planted bugs, which must FAIL:
"scale" ours with its scale 1% off, and in the causal cases "causal+1" ours with each row
seeing one key past the diagonal.

Every configuration judges every case in its own child process, which prints each report as
JSON (CrosscheckReport.to_json); a line on stderr as each one is done. The table: per
configuration, the kernel the child's threadpool_info reported, the child's seconds judging,
how many tensor verdicts differ from the default configuration's (must be 0), and the largest
relative difference |a - b| / max(|a|, |b|) of a printed figure (FIGURES, per tensor) from the
default's, and where.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import ChildFailed, OtherLoad, machine_line, repo_root, run_child, table  # noqa: E402
from numpy_attention import attention_backward, attention_forward  # noqa: E402
from numpy_attention.oracle import save_case  # noqa: E402

# OpenBLAS's names of x86-64 kernels, newest first; several share a kernel (Zen: Haswell's)
CORETYPES = ("SapphireRapids", "Cooperlake", "SkylakeX", "Zen", "Haswell", "Excavator", "Sandybridge",
             "Barcelona", "Nehalem", "Atom", "Core2", "Prescott", "Katmai")
PRECISIONS = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SMALL = (2, 4, 2, 96, 80, 32)           # B, H, H_kv (the grouped variant's), N_q, N_k, d
LARGE = (1, 8, 8, 2048, 2048, 64)
VARIANTS = ("plain", "causal", "mask", "bias_gqa_causal")
FIGURES = ("baseline_err", "max_abs_err", "bound", "atol")
HONEST = ("ours", "torch")

SAY_KERNEL = """
import threadpoolctl
print("KERNEL", ", ".join(lib.get("architecture") for lib in threadpoolctl.threadpool_info()
                          if lib["internal_api"] == "openblas"))
"""

PROBE = """
import numpy as np
a = np.ones((300, 300))
assert (a @ a)[0, 0] == 300
""" + SAY_KERNEL

JUDGE = """
import json, time
from numpy_attention.oracle import crosscheck, load_case
start = time.perf_counter()
for name, path in {cases!r}:
    report = crosscheck(**load_case(path), workers={workers})
    print("REPORT", name, json.dumps(json.loads(report.to_json())))
print("SECONDS", time.perf_counter() - start)
""" + SAY_KERNEL


def said(stdout, key):
    """The values of the child's lines `key ...` (the rest of each line)."""
    return [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith(key + " ")]


def kernels(coretypes):
    """[(name, the kernel it loads or None, why not)] for each OPENBLAS_CORETYPE name, the
    default (OPENBLAS_CORETYPE unset, named None) first."""
    found = []
    for name in (None,) + tuple(coretypes):
        try:
            found.append((name, said(run_child(PROBE, env={"OPENBLAS_CORETYPE": name})[1], "KERNEL")[0], ""))
        except ChildFailed as failure:
            found.append((name, None, failure.reason))
    return found


def configurations(found):
    """[(OPENBLAS_CORETYPE or None, BLAS threads, workers)]: the default, and for each other
    kernel that loads one name (its own if it is among them, else the first)."""
    chosen = {}
    for name, kernel, _ in sorted(found[1:], key=lambda f: f[0] != f[1]):    # its own name first
        if kernel not in (None, found[0][1]):
            chosen.setdefault(kernel, name)
    names = [None] + [name for name, _, _ in found[1:] if name in chosen.values()]
    return [(name, threads, workers) for name in names for threads in (1, 2) for workers in (1, 2)]


def make_case(rng, precision, variant, shape):
    """q, k, v, dout (float32 arrays holding values of `precision`), the precision and the
    variant's options: the keys crosscheck and tests/real_kernels.py's runners take."""
    b, h, h_kv, n_q, n_k, d = shape
    h_kv = h_kv if variant == "bias_gqa_causal" else h
    rounded = lambda x: x.astype(PRECISIONS[precision]).astype(np.float32)
    case = {"q": rounded(rng.standard_normal((b, h, n_q, d))), "k": rounded(rng.standard_normal((b, h_kv, n_k, d))),
            "v": rounded(rng.standard_normal((b, h_kv, n_k, d))), "dout": rounded(rng.standard_normal((b, h, n_q, d))),
            "precision": np.array(precision)}
    if "causal" in variant:
        case["causal"] = np.array(True)
    if variant == "mask":
        case["mask"] = rng.random((b, 1, n_q, n_k)) < 0.7
        case["mask"][..., 0] = True                         # no row without a key
    if variant.startswith("bias"):
        case["bias"] = rounded(rng.standard_normal((b, h, n_q, n_k)))
    return case


def ours(case, bug=None):
    """Our float64 attention's out, lse, dq, dk, dv (dbias) on the case, rounded to its precision,
    with `bug` planted: "scale" 1% off, "causal+1" each row seeing one key past the diagonal."""
    wide = {n: case[n].astype(np.float64) for n in ("q", "k", "v", "dout", "bias") if n in case}
    n_q, n_k, d = case["q"].shape[-2], case["k"].shape[-2], case["q"].shape[-1]
    keep = case.get("mask")
    causal = "causal" in case
    if bug == "causal+1":
        shifted = np.arange(n_k)[None, :] <= np.arange(n_q)[:, None] + 1
        keep, causal = shifted if keep is None else keep & shifted, False
    out, cache = attention_forward(wide["q"], wide["k"], wide["v"], mask=keep, bias=wide.get("bias"),
                                   causal=causal, scale=(1.01 if bug == "scale" else 1) / math.sqrt(d))
    grads = attention_backward(wide["dout"], cache)
    dtype = PRECISIONS[str(case["precision"])]
    results = {"out": out.astype(dtype), "lse": cache.lse.astype(np.float32), "dq": grads.dq.astype(dtype),
               "dk": grads.dk.astype(dtype), "dv": grads.dv.astype(dtype)}
    if "bias" in case:
        results["dbias"] = grads.dbias.astype(dtype)
    return {**case, **results}


def torch_sdpa(case):
    """torch's SDPA math backend in the case's precision (tests/real_kernels.py's runner)."""
    sys.path.insert(0, os.path.join(repo_root(), "tests"))
    import real_kernels
    return real_kernels.run(case, "sdpa_math")


def write_cases(directory, large):
    """Write every (case, candidate) as .npz in `directory`: [(name, path)]."""
    rng = np.random.default_rng(0)
    shapes = [(p, v, SMALL) for p in PRECISIONS for v in VARIANTS] + [("bfloat16", "causal", LARGE)] * large
    has_torch = importlib.util.find_spec("torch") is not None
    written = []
    for precision, variant, shape in shapes:
        case = make_case(rng, precision, variant, shape)
        candidates = ["ours"] + ["torch"] * has_torch + ["scale"] + ["causal+1"] * ("causal" in case)
        for candidate in candidates:
            name = f"{precision}/{variant}/{'x'.join(map(str, shape[3:5]))}/{candidate}"
            path = os.path.join(directory, name.replace("/", "_") + ".npz")
            bug = None if candidate in HONEST else candidate
            save_case(path, **(torch_sdpa(case) if candidate == "torch" else ours(case, bug)))
            written.append((name, path))
    return written


def judge(cases, coretype, threads, workers):
    """(kernel reported, seconds, {case name: report dict}) of one configuration's child."""
    env = {"OPENBLAS_CORETYPE": coretype, "OPENBLAS_NUM_THREADS": str(threads)}
    stdout = run_child(JUDGE.format(cases=cases, workers=workers), env=env)[1]
    reports = {name: json.loads(text) for name, text in (line.split(" ", 1) for line in said(stdout, "REPORT"))}
    return said(stdout, "KERNEL")[0], float(said(stdout, "SECONDS")[0]), reports


def relative(a, b):
    """|a - b| / max(|a|, |b|); 0 where equal (JSON's null, "inf" included), inf where one is not a number."""
    if a == b:
        return 0.0
    if not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def compare(reports, default):
    """(tensor verdicts differing, tensor verdicts, largest relative difference of FIGURES, where)."""
    differ = total = 0
    largest, where = 0.0, "-"
    for name, report in default.items():
        for row, row0 in zip(reports[name]["tensors"], report["tensors"]):
            total += 1
            differ += row["passed"] != row0["passed"]
            for figure in FIGURES:
                r = relative(row[figure], row0[figure])
                if r > largest:
                    largest, where = r, f"{name} {row['name']} {figure}"
    return differ, total, largest, where


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--coretypes", nargs="+", default=list(CORETYPES),
                    help="OPENBLAS_CORETYPE names to try (default: OpenBLAS's x86-64 kernels)")
    ap.add_argument("--no-large", action="store_true", help="leave out the large case")
    args = ap.parse_args()
    print(machine_line())
    load = OtherLoad()
    found = kernels(args.coretypes)
    print(table(["OPENBLAS_CORETYPE", "kernel loaded"], [[name or "(unset)", kernel or f"none: {why}"]
                                                          for name, kernel, why in found]))
    with tempfile.TemporaryDirectory() as directory:
        cases = write_cases(directory, large=not args.no_large)
        configs, results = configurations(found), []
        for i, config in enumerate(configs, 1):
            results.append((config, judge(cases, *config)))
            print(f"configuration {i} of {len(configs)} judged", file=sys.stderr, flush=True)
    default = results[0][1][2]
    honest = [name for name in default if name.rsplit("/", 1)[1] in HONEST]
    print(f"\n{len(cases)} cases; the default configuration: {sum(default[n]['passed'] for n in honest)} of "
          f"{len(honest)} honest candidates pass, {sum(not r['passed'] for n, r in default.items() if n not in honest)}"
          f" of {len(default) - len(honest)} planted bugs fail")
    for name, report in default.items():
        if report["passed"] != (name in honest):
            print(f"  {'FAIL' if name in honest else 'PASS'}: {name}")
    rows = []
    for (coretype, threads, workers), (kernel, seconds, reports) in results:
        differ, total, largest, where = compare(reports, default)
        rows.append([coretype or "(unset)", str(threads), str(workers), kernel, f"{seconds:.0f}",
                     f"{differ} of {total}", f"{largest:.2g}", where])
    print(table(["OPENBLAS_CORETYPE", "BLAS threads", "workers", "kernel", "seconds", "verdicts differing",
                 "largest rel diff", "where"], rows))
    print(load.line())


if __name__ == "__main__":
    main()
