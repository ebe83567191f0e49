"""`GatedQwen3Config`: the HF config of the gated Qwen3-style LM (dense or MoE), `model_type="gated_qwen3"`.

Keys are stock HF Qwen3's (so stock configs convert by renaming nothing), plus the gate (`gate`, `gate_init`,
`use_qk_norm`), the MoE keys named as HF Qwen3-MoE's, and the baseline mechanisms of the paper's comparisons.
Unknown keys and incompatible settings fail loudly instead of being stored and ignored.
"""
from __future__ import annotations

from transformers import PreTrainedConfig
from transformers.generation import GenerationConfig
from transformers.modeling_rope_utils import RopeParameters

from .gates import GATE_INITS, canonical_name

LAYER_TYPES = ("full_attention", "sliding_attention")

# Keys transformers itself writes to / reads from config.json; everything else must be a declared field.
_HF_KEYS = {
    "transformers_version", "architectures", "model_type", "auto_map", "torch_dtype", "dtype", "_name_or_path",
    "name_or_path", "output_attentions", "output_hidden_states", "attn_implementation", "experts_implementation",
    "rope_scaling", "rope_theta", "partial_rotary_factor", "return_dict", "use_return_dict", "tie_encoder_decoder",
    "is_decoder", "add_cross_attention", "num_labels", "id2label", "label2id", "problem_type", "task_specific_params",
    "chunk_size_feed_forward", "is_encoder_decoder", "pruned_heads", "torchscript", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "finetuning_task", "cross_attention_hidden_size", "output_scores",
    "per_layer_config", "_attn_implementation_autoset", "use_bfloat16", "tf_legacy_loss",
}


class GatedQwen3Config(PreTrainedConfig):
    model_type = "gated_qwen3"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    # --- stock Qwen3 keys (same names, same meaning) ---
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016  # dense SwiGLU width; presets shrink it for gated variants at parameter parity
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32  # GQA: H must be a multiple of KV
    head_dim: int = 128  # decoupled from hidden_size (the 1.7B-48L model has H*D != d)
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02  # every Linear/Embedding ~ N(0, std), as the official code
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None  # HF schema: {"rope_type", "rope_theta", ...}
    attention_bias: bool = False  # q/k/v/o (and gate) biases; the official code calls this `qkv_bias`
    o_proj_bias: bool | None = None  # None: as attention_bias (Qwen3, Llama); False with attention_bias: Qwen2
    attention_dropout: float | int = 0.0
    use_sliding_window: bool = False  # kept for stock-config compatibility; True is rejected (use layer_types)
    sliding_window: int | None = None  # window (keys per query, itself included) of "sliding_attention" layers
    max_window_layers: int = 28  # Qwen2/Qwen3 key, carried for export; layer_types decides what runs
    layer_types: list[str] | None = None  # per layer "full_attention" (default) or "sliding_attention" (Mistral)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # --- the gate ---
    use_qk_norm: bool = True  # Qwen3 QK-norm (RMSNorm over head_dim before RoPE); switchable as in the official code
    gate: str = "none"  # a name from gated_attention.gates.GATES ("none" = ungated; alias "baseline")
    gate_init: str = "normal"  # "normal": official N(0, std) init, gate ~0.5; "identity": zero weights, score 1 at start
    # --- MoE (HF Qwen3-MoE names); num_experts == 0 means a dense model ---
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    router_aux_loss_coef: float = 0.001  # global-batch load-balancing loss weight
    router_z_loss_coef: float = 0.0  # router z-loss weight
    decoder_sparse_step: int = 1  # every k-th layer is MoE
    mlp_only_layers: list[int] | None = None  # layers forced dense
    shared_expert_intermediate_size: int = 0  # 0 = no shared expert
    moe_impl: str = "grouped"  # "loop" (reference) | "grouped" (fast path)
    # --- the paper's comparison mechanisms (gated_attention.mechanisms) ---
    mechanism: str = "none"  # a runtime mechanism from mechanisms.MECHANISMS (Switch Heads, sinks, FoX, ...), or "none"
    softmax_zeta: float = 1.0  # clipped_softmax stretch (>= 1): above 1 lets probabilities reach exactly 1
    softmax_gamma: float = -0.03  # clipped_softmax shift (<= 0): lets probabilities reach exactly 0

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        unknown = sorted(k for k in kwargs if k not in _HF_KEYS and k not in GenerationConfig._get_default_generation_params())
        if unknown:
            raise ValueError(f"GatedQwen3Config: unknown key(s) {unknown}; they would be silently ignored. "
                             f"Valid model keys: {sorted(self.__dataclass_fields__)}")
        if kwargs.get("rope_theta") is not None and self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": kwargs["rope_theta"]}
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        self.gate = canonical_name(self.gate)
        if self.gate_init not in GATE_INITS:
            raise ValueError(f"unknown gate_init {self.gate_init!r}; valid: {', '.join(GATE_INITS)}")
        _check_numbers(self)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=True is not supported; mark the windowed layers in layer_types "
                             "('sliding_attention') and set sliding_window")
        if self.moe_impl not in ("loop", "grouped"):
            raise ValueError(f"unknown moe_impl {self.moe_impl!r}; valid: loop, grouped")
        from .mechanisms import validate_config

        validate_config(self)
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self._check_layer_types()
        super().__post_init__(**kwargs)
        if self.gate != "none":  # validate the gate/init pair now, not at model build time
            from .gate_layer import Gate
            from .gates import get_gate

            Gate(get_gate(self.gate), 8, 2, 1, 4, init=self.gate_init)  # raises for an init that cannot exist

    def _check_layer_types(self) -> None:
        types = list(self.layer_types)
        bad = sorted({t for t in types if t not in LAYER_TYPES})
        if bad or len(types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must list one of {LAYER_TYPES} per layer ({self.num_hidden_layers}); "
                             f"got {len(types)} entries" + (f" with unknown {bad}" if bad else ""))
        if "sliding_attention" in types:
            w = self.sliding_window
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"layer_types has 'sliding_attention' layers but sliding_window={w!r}; "
                                 "set sliding_window to the window length (a positive int)")
            if self.mechanism != "none":
                raise ValueError(f"mechanism={self.mechanism!r} with sliding-window layers is not supported "
                                 "(its attention hooks assume full causal attention)")

    @property
    def has_sliding_layers(self) -> bool:
        return "sliding_attention" in (self.layer_types or ())

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in (self.mlp_only_layers or [])
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "decoder_sparse_step")
_NONNEG_INTS = ("num_experts", "shared_expert_intermediate_size")


def _check_numbers(cfg: GatedQwen3Config) -> None:
    """Sizes >= 1, finite positive scales: a zero head count or a NaN RoPE theta fails here, by name, not as a
    ZeroDivisionError deep in the model or a NaN config.json."""
    from .util.errors import check_number

    for name in _POSITIVE_INTS:
        check_number(name, getattr(cfg, name), kind=int, min=1)
    for name in _NONNEG_INTS:
        check_number(name, getattr(cfg, name), kind=int, min=0)
    check_number("initializer_range", cfg.initializer_range, min=0.0, min_open=True)
    check_number("rms_norm_eps", cfg.rms_norm_eps, min=0.0, min_open=True)
    check_number("attention_dropout", cfg.attention_dropout, min=0.0, max=1.0)
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        check_number(name, getattr(cfg, name), min=0.0)
    if cfg.num_experts > 0:
        check_number("num_experts_per_tok", cfg.num_experts_per_tok, kind=int, min=1, max=cfg.num_experts)
        check_number("moe_intermediate_size", cfg.moe_intermediate_size, kind=int, min=1)
    rp = cfg.rope_parameters
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            check_number("rope_theta", rp["rope_theta"], min=0.0, min_open=True)
        if rp.get("factor") is not None:
            check_number("rope factor", rp["factor"], min=1.0)


__all__ = ["GatedQwen3Config"]
