"""Backends that kill, hang or poison their process (tests/meta/test_isolation.py, fault_scenarios.py)."""
