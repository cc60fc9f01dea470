"""An implementation that cannot be imported or constructed because of its environment gets one line naming the root
cause (the innermost exception of the chain: torchvision's "operator torchvision::nms does not exist" under
transformers' "Could not import module 'DeepseekV2ForCausalLM'"), not the wrapper's message; the per-codec golden
test asks the backend whether it takes the codec before it loads the model (issue 45)."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

from mla_conformance.errors import BackendSpecError, PackageImportError, environment_line, root_cause
from mla_conformance.specs import get_backend, get_op

NMS = "operator torchvision::nms does not exist"
WRAPPER = "Could not import module 'DeepseekV2ForCausalLM'. Are this object's requirements defined correctly?"


def _transformers_like_failure():
    """What transformers raises in a venv whose torchvision does not load: the lazy import's ModuleNotFoundError from
    its RuntimeError from torchvision's."""
    try:
        try:
            raise RuntimeError(NMS)
        except RuntimeError as inner:
            raise RuntimeError("Failed to import transformers.models.deepseek_v2.modeling_deepseek_v2 because of the "
                               f"following error (look up to see its traceback):\n{inner}") from inner
    except RuntimeError as middle:
        raise ModuleNotFoundError(WRAPPER) from middle


def test_root_cause_and_its_line():
    with pytest.raises(ModuleNotFoundError) as info:
        _transformers_like_failure()
    assert str(root_cause(info.value)) == NMS
    assert environment_line(info.value) == f"RuntimeError: {NMS} (the root cause; it surfaced as ModuleNotFoundError)"
    plain = ValueError("one\ntwo")
    assert root_cause(plain) is plain and environment_line(plain) == "ValueError: one"
    try:  # a context (raised while handling another) counts; a suppressed one (raise ... from None) does not
        try:
            raise OSError("libcudart.so.12: cannot open shared object file")
        except OSError:
            raise ImportError("kernel extension failed to load")
    except ImportError as exc:
        assert environment_line(exc).startswith("OSError: libcudart.so.12")


@pytest.mark.parametrize("where", ["import", "construct"])
@pytest.mark.parametrize("kind", ["op", "backend"])
def test_a_spec_that_fails_in_its_environment_names_the_root_cause(tmp_path, where, kind):
    body = {"import": """
        from tests.test_environment_errors import _transformers_like_failure
        _transformers_like_failure()
        """, "construct": """
        from tests.test_environment_errors import _transformers_like_failure

        class Impl:
            name = "impl"

            def __init__(self):
                _transformers_like_failure()

            def unsupported_reason(self, *args, **kwargs):
                return None

            def decode(self, *args, **kwargs):
                raise NotImplementedError
        """}[where]
    path = tmp_path / f"impl_{where}_{kind}.py"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    with pytest.raises(BackendSpecError) as info:
        (get_op if kind == "op" else get_backend)(f"{path}:Impl")
    msg = str(info.value)
    assert "\n" not in msg and f"RuntimeError: {NMS}" in msg, msg
    assert "Are this object's requirements" not in msg and "Failed to import" not in msg, msg
    assert ("importing" if where == "import" else "instantiating Impl") in msg, msg


def test_load_model_names_what_breaks_transformers(monkeypatch):
    from mla_conformance.generation.generate import DEFAULT_MODEL, load_model

    class Broken(types.ModuleType):
        def __getattr__(self, name):
            _transformers_like_failure()

    monkeypatch.setitem(sys.modules, "transformers", Broken("transformers"))
    with pytest.raises(PackageImportError) as info:
        load_model(DEFAULT_MODEL)
    assert str(info.value) == (f"transformers' DeepseekV2ForCausalLM does not import in this environment: RuntimeError: "
                               f"{NMS} (the root cause; it surfaced as ModuleNotFoundError)")


def test_the_per_codec_golden_asks_before_loading_the_model():
    """A backend that declines the codec skips with its sentence; the model (and transformers) is never loaded."""
    from mla_conformance.checks.layer import golden
    from mla_conformance.impl.ops.layer import OpBackend
    from mla_conformance.impl.ops.reference import ReferenceOp

    def model():
        raise AssertionError("the model was loaded before the backend was asked")

    with pytest.raises(pytest.skip.Exception, match="kv_codec 'int8-g32' is neither"):
        golden.check_golden_generation_per_codec(OpBackend(ReferenceOp()), "int8-g32", 0.99, model, None, None, "cpu",
                                                 {})
