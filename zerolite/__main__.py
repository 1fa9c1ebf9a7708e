"""python -m zerolite: the command line (zerolite.cli.app)."""

from zerolite.cli.app import main

main()
