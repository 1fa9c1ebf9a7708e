"""python -m zerolite: the command line (zerolite.cli.main)."""

from zerolite.cli.main import main

main()
