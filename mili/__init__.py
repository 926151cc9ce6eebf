"""MILI: an inference engine and server for Qwen3 models."""

__version__ = "0.1.0"

from mili.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError  # noqa: E402
from mili.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from mili.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it lazily so `import mili` stays light.
    if name == "LLM":
        from mili.llm import LLM

        return LLM
    if name == "LoRARequest":
        from mili.lora import LoRARequest

        return LoRARequest
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "InvalidRequest", "ContextLengthExceeded", "ModelLoadError", "__version__"]
