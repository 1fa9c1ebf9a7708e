"""Mixtures of experts: only the experts the router picks are read, cached and guessed ahead."""
