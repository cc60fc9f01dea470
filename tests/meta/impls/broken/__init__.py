"""Broken implementations: each fails its named test (tests/meta/kill_matrix.py, test_meta.py, test_op_meta.py)."""
