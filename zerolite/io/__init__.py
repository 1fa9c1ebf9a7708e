"""The I/O engine's Python face, host memory and the device: everything that moves bytes."""
