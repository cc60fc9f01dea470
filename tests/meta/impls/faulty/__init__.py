"""Backends that kill, hang or poison their process (tests/meta/test_isolation.py, test_fault_scenarios.py)."""
