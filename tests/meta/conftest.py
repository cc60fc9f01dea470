"""torch, transformers' DeepSeek models and hypothesis (the inner runs of the generated cases import it) are imported
before any meta test sets up its ``pytester``: pytester drops the modules imported after its set-up when the test
ends, and the next test imports them again. torch must never be imported twice: transformers' models import torch
submodules (torch._dynamo, torch.distributed) that register native libraries, and a second registration raises
("Only a single TORCH_LIBRARY can be used to register the namespace c10d_functional"); hypothesis costs seconds a run.

They are imported by a session fixture every meta test uses, not when this file loads: under pytest-xdist the
controller process loads this file too and runs no test, and the imports take seconds before any worker starts.
"""

import pytest


@pytest.fixture(scope="session", autouse=True)
def _modules_pytester_must_not_drop():
    import hypothesis  # noqa: F401
    import torch  # noqa: F401
    from transformers import DeepseekV2ForCausalLM  # noqa: F401

    try:  # transformers >= 5.x ships DeepSeek-V4 (its goldens skip without it)
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError:
        pass
