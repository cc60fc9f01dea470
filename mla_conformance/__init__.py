"""mla-conformance: a pytest conformance suite for DeepSeek Multi-head Latent Attention."""

__version__ = "0.1.0"

__all__ = ["MLAConfig", "MLAWeights", "__version__"]


def __getattr__(name):
    # lazy: the pytest plugin (mla_conformance.pytest_plugin) loads in every pytest run of the environment, and
    # importing the package must not import torch there
    if name == "MLAConfig":
        from mla_conformance.model.config import MLAConfig  # lazy: see above

        return MLAConfig
    if name == "MLAWeights":
        from mla_conformance.model.weights import MLAWeights  # imports torch: lazy, see above

        return MLAWeights
    raise AttributeError(f"module 'mla_conformance' has no attribute {name!r}")
