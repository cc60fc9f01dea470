"""Correct implementations written without mla_conformance's reference; the suite must pass them."""
