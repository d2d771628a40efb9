"""lmlab: build, train, probe and compare Transformer language models."""

__version__ = "0.1.0"
