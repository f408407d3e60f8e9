"""pagedserve: fast, practical serving of small LLMs."""

from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.version import __version__

__all__ = ["LLM", "LoRARequest", "RequestOutput", "CompletionOutput", "Logprob", "SamplingParams",
           "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from pagedserve.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput", "Logprob"):
        from pagedserve import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
