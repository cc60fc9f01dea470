"""Serving engines end to end (issue 43): the engine contract (contract.py), built-in adapters (vllm.py, sglang.py),
each configuration in a subprocess of its own (run.py, worker.py), the float64 reference with log-probabilities
(reference.py), the rules (checks.py), the suite's runs and test bodies (session.py, suite.py) and the report's
engine rows (report.py). docs/engines.md."""
