"""python -m zerolite: the command line (zerolite.cli)."""

from zerolite.cli import main

main()
