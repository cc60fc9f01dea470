"""Goldens (syrupy snapshots). Installed, this is the package ``mla_conformance.goldens`` (see setup.py)."""
