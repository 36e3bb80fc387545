"""ModelArch: the few numbers of a Llama-family config our forward needs, read from an HF config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachecraft.errors import ModelLoadError

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, slots=True)
class ModelArch:
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token at 2 bytes per value (fp16 storage)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelArch:
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported architecture {model_type!r}; supported: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        # Qwen2 always has q/k/v bias; Llama/Mistral only when attention_bias is set.
        attention_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        if getattr(config, "mlp_bias", False):
            raise ModelLoadError("models with mlp_bias=True are not supported")
        window = getattr(config, "sliding_window", None)
        if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            sliding_window=window,
        )
