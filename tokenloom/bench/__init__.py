"""Benchmark tools: seeded workloads, a streaming serving load generator,
offline throughput through ``tokenloom.LLM`` and the statistics/plots they share."""
