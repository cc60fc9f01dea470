"""The conformance suites. Installed, this is the package ``mla_conformance.suites`` (see setup.py)."""
