"""Corpora, tokenizers, token caches and batching."""
