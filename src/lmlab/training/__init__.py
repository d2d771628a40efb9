"""Optimisation, checkpoints, metrics and the training loop."""
