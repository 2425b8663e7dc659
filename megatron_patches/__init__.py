"""Explicit, named patches that let megatron-core run on CPU with gloo.

Nothing is patched on import: call :func:`apply` once (launch/ and tests do).
Each patch module names its target symbol, the reason, the supported
megatron-core versions and when it can go.
"""
