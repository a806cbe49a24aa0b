"""The commands of `private-t5 <stage>`: flags, Gin files and one-line errors.

The top layer: only this package imports gin, argparse and the flag helpers; it builds the
objects of the layers below and calls them, and nothing below imports it. `cli.py` is the
console entry point; `flags`, `verbosity` and the `gin_*` modules are the command line's helpers;
each other module is one stage with a `main(argv) -> int`.
"""
