"""Implementations the meta tests run the suite against, one folder per kind (the test modules are one level up):

* ``broken/`` -- each wrong in one named way; the meta tests require the named test to *fail* on it (not error);
* ``independent/`` -- correct, written without mla_conformance's reference (from the papers, DeepSeek's and
  transformers' code); the suite must pass them;
* ``kernel_style/`` -- correct, computing as production kernels do (half-precision accumulation, split-KV, padded
  CUDA-graph batches, wide geometry); they hold the bounds to what real kernels need;
* ``faulty/`` -- kill, hang or poison the process that runs them; a crash is a verdict, never a lost run.

The frozen base backend and op (``tests/meta/frozen_base_backend.py``, ``frozen_base_op.py``) stay where the
developers' guide names them: written once to the base contracts and never edited, so yesterday's code keeps
yesterday's verdict.
"""
