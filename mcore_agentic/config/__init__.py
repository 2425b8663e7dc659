"""Structured run config: the tree of per-package dataclasses, Hydra loading and cross-group validation."""
