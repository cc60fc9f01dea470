"""Checks of the layer contract (mla_conformance.contract.layer): a backend's attend() through scenarios --
its numerics, padded batches, cache bytes, quantized and paged caches, DSA, conventions, checkpoints and golden
generations, and the float64 oracles of the bug classes a failure names (diagnose)."""
