"""specdec: speculative decoding on edge devices. `import specdec` pulls in the runtime only
(numpy, onnxruntime, tokenizers), never torch or transformers."""
from specdec.errors import SpecdecError
from specdec.runtime.engine import Engine, Generation, GenerationConfig, load
from specdec.runtime.sampling import SamplingConfig
from specdec.runtime.session import RuntimeOptions
from specdec.version import __version__

__all__ = ["Engine", "Generation", "GenerationConfig", "RuntimeOptions", "SamplingConfig", "SpecdecError", "load",
           "__version__"]
