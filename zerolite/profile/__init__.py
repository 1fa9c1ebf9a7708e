"""Measuring a run and the machine, and saying what limits the speed."""
