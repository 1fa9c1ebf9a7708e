"""The on-disk format: the manifest, a layout folder, a model's blocks, and reading them back."""
