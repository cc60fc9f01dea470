"""Broken implementations: each fails its named test (tests/meta/test_kill_matrix.py, test_meta.py, test_op_meta.py, test_op_methods_meta.py)."""
