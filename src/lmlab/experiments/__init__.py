"""Experiments: train variants of a base config over seeds, then compare them (lmlab compare)."""
