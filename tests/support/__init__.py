"""What the tests share: tiny models and their layouts, the simulated devices, running the command line and
the tools in-process, a live server. pytest puts tests/ on the path (pyproject's pythonpath), so a test
imports these as `support.NAME`."""
