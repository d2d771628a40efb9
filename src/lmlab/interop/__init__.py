"""Weights and configs of other libraries mapped onto lmlab's components, in one place."""
