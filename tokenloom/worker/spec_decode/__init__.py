"""Speculative decoding: draft proposers (n-gram, draft model), verification by
rejection sampling, the per-request draft budget, and acceptance statistics.

Importing this package loads nothing heavy: the scheduler (pure Python) uses
``metrics`` and the runner imports the torch parts directly.
"""
