"""The architectures ggrun runs: GGUF architecture name -> the model class that computes it. What
each one is otherwise (hyperparameter defaults, tensor names, conversion) is declared in
gguf_io.architectures."""
from .exaone4 import EXAONE4
from .falcon_h1 import FalconH1
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .gemma4 import Gemma4
from .glm4 import GLM4
from .gpt_oss import GptOss
from .granite_hybrid import GraniteHybrid
from .lfm2 import LFM2, LFM2MoE
from .llama import Llama
from .nemotron_h import NemotronH, NemotronHMoE
from .olmo2 import OLMo2
from .olmoe import OLMoE
from .phi3 import Phi3
from .plain_mamba2 import PlainMamba2
from .qwen import Qwen2, Qwen3
from .qwen35 import Qwen3Next, Qwen35
from .seed_oss import SeedOSS
from .smollm3 import SmolLM3

# A mixture-of-experts architecture whose block is a dense one's (Qwen 2/3-MoE; Mixtral is
# "llama") runs its model: the decoder loads a mixture wherever a layer has a router.
MODELS = {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3": Gemma3, "qwen2moe": Qwen2, "qwen3moe": Qwen3,
          "olmoe": OLMoE, "olmo2": OLMo2, "smollm3": SmolLM3, "ernie4_5": Llama, "granite": Llama, "granitemoe": Llama,
          "phi3": Phi3, "gemma2": Gemma2, "glm4": GLM4, "exaone4": EXAONE4, "seed_oss": SeedOSS,
          "mistral3": Llama, "gpt-oss": GptOss, "gemma4": Gemma4,
          "lfm2": LFM2, "lfm2moe": LFM2MoE, "qwen35": Qwen35, "qwen35moe": Qwen35, "qwen3next": Qwen3Next,
          "granitehybrid": GraniteHybrid, "nemotron_h": NemotronH, "nemotron_h_moe": NemotronHMoE,
          "mamba2": PlainMamba2, "falcon-h1": FalconH1}
