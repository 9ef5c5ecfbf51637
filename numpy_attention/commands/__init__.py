"""The `numpy-attention` command line: each command only calls the library.

    cli.py          main(argv): the parser, one error style, exit codes; UsageError, integer
    demo.py         numpy-attention demo         the seed's example, every gradient verified
    gradcheck.py    numpy-attention gradcheck    every op's backward against finite differences
    vanishing.py    numpy-attention vanishing    the 1/sqrt(d_k) study
    crosscheck.py   numpy-attention crosscheck   judge another attention against the oracle
    conform.py      numpy-attention conform      sweep a kernel over the case grid, shrink each failure

Each command module provides HELP (its line in the command list), DESCRIPTION (its --help),
optionally EPILOG, add_arguments(parser) and run(args) -> exit code.
"""
