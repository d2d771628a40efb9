"""Scoring text with a trained model: loss, perplexity, bits per byte."""
