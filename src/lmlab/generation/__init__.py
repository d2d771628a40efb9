"""Sampling and the KV-cached decode loop."""
