"""mla-conformance: a pytest conformance suite for DeepSeek Multi-head Latent Attention."""

from mla_conformance.config import MLAConfig
from mla_conformance.weights import MLAWeights

__version__ = "0.1.0"

__all__ = ["MLAConfig", "MLAWeights", "__version__"]
