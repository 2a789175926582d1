"""Scheduling and KV-cache bookkeeping: pure Python, no torch."""
