"""The architectures ggrun runs: GGUF architecture name -> the model class that computes it. What
each one is otherwise (hyperparameter defaults, tensor names, conversion) is declared in
gguf_io.architectures."""
from .gemma3 import Gemma3
from .llama import Llama
from .qwen import Qwen2, Qwen3

MODELS = {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3": Gemma3}
