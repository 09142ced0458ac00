"""Language-model engines behind one protocol (`protocol.Engine`), chosen by a spec string.

    from thinkcraft.llm import make_engine
    eng = make_engine("hf:default")            # in-process transformers, bundled SmolLM2-135M
    eng = make_engine("sglang+http://127.0.0.1:30000")
"""

from thinkcraft.llm.protocol import (  # noqa: F401
    Batch,
    Capabilities,
    Completion,
    Engine,
    EngineCapabilityError,
    EngineError,
    SamplingParams,
)


def make_engine(spec: str, **options):  # noqa: ANN001, ANN201
    """Build an engine from its spec string (see `thinkcraft.llm.registry`)."""
    from thinkcraft.llm.registry import make_engine as _make

    return _make(spec, **options)
