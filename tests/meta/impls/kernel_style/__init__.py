"""Correct ops computing as production kernels and engines do (half-precision accumulation, split-KV, padded batches)."""
