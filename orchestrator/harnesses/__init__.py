"""Harnesses: one adapter contract (`base.Harness`), one module per harness (H1, H2)."""
