"""The gated Qwen3-style causal LM (dense or MoE), HF-native: `GatedQwen3Model` and `GatedQwen3ForCausalLM`.

Single-device code with stock Qwen3 parameter names. Training, parallelism, analysis and long-context tools are
functions applied to a built model; nothing here imports them. Masks and the KV cache are transformers' own
(`create_causal_mask`, `DynamicCache`/`StaticCache`), so `generate()` works as for any HF model.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .attention import GatedAttention
from .mechanisms import AttentionMechanism, build_branch_transforms
from .norm import RMSNorm
from .configuration import GatedQwen3Config
from .gate_layer import Gate
from .gates import Source
from .rope import RotaryEmbedding, compute_rope_parameters


class MLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, config: GatedQwen3Config, intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        from transformers.activations import ACT2FN

        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def build_ffn(config: GatedQwen3Config, layer_idx: int) -> nn.Module:
    if config.is_moe_layer(layer_idx):
        from .moe import SparseMoeBlock

        return SparseMoeBlock(config)
    return MLP(config)


class GatedQwen3DecoderLayer(GradientCheckpointingLayer):
    """Pre-norm block: x + attn(norm(x)), then x + ffn(norm(x))."""

    def __init__(self, config: GatedQwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = GatedAttention(config, layer_idx)
        self.mlp = build_ffn(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # identity, or a baseline on each branch output before its residual add (sandwich norm / clipping to +-c)
        self.attn_output_transform, self.ffn_output_transform = build_branch_transforms(config)
        self.capture = None

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, cache=None, **kwargs):
        h, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache, **kwargs)
        h = self.attn_output_transform(h)
        hidden_states = hidden_states + h
        if self.capture is not None:
            self.capture(self.layer_idx, "attn_output", h)
            self.capture(self.layer_idx, "attn_residual", hidden_states)
        h = self.ffn_output_transform(self.mlp(self.post_attention_layernorm(hidden_states)))
        hidden_states = hidden_states + h
        if self.capture is not None:
            self.capture(self.layer_idx, "ffn_output", h)
            self.capture(self.layer_idx, "ffn_residual", hidden_states)
        return hidden_states


class _ExactRecompute:
    """The function one checkpointed layer call runs: its first call is the forward, any later call the recompute in
    backward, which must rebuild the same graph. The recompute re-enters the bf16 GEMM emulation the forward ran in
    (a Python mode: torch.utils.checkpoint restores autocast and RNG, not modes; the backward runs outside it) and
    replays the MoE blocks' routing the forward recorded (moe.py) instead of deciding again."""

    def __init__(self, function, keeps_collectives: bool = False):
        from .util.bf16_emulation import emulating

        self.function = function
        self.emulated = emulating()  # the numerics the forward runs in (checked when the layer is called)
        from .moe import RoutingRecord

        self.routing = RoutingRecord(keeps_collectives)
        self.calls = 0

    def __call__(self, *args, **kwargs):
        from .moe import routing_record, routing_replay
        from .util.bf16_emulation import emulated_bf16

        self.calls += 1
        if self.calls == 1:
            with routing_record(self.routing):
                return self.function(*args, **kwargs)
        with routing_replay(self.routing), emulated_bf16() if self.emulated else contextlib.nullcontext():
            return self.function(*args, **kwargs)


def exact_checkpoint(checkpoint_fn=None, traceable: bool = True, keeps_collectives: bool = False):
    """A decoder layer's checkpoint function (`checkpoint_fn(function, *args, **kwargs)`, torch.utils.checkpoint
    non-reentrant by default) whose recompute is identical to the forward (_ExactRecompute). `traceable` (a layer
    without MoE blocks): under torch.compile the plain checkpoint is traced into the layer's graph, whose recompute is
    the compiled graph's own. An MoE layer always records and replays its routing (its Python-side statistics keep
    the checkpoint out of the compiled graph anyway, so the checkpoint runs eagerly around the compiled parts).
    `keeps_collectives`: checkpoint_fn's recompute is handed the collectives' forward outputs (moe.RoutingRecord)."""
    checkpoint_fn = checkpoint_fn or functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    @functools.wraps(checkpoint_fn)
    def checkpoint(function, *args, **kwargs):
        if traceable and torch.compiler.is_compiling():
            return checkpoint_fn(function, *args, **kwargs)
        return checkpoint_fn(_ExactRecompute(function, keeps_collectives), *args, **kwargs)

    return checkpoint


def set_exact_checkpointing(layers, checkpoint_fn=None, enable: bool = True, keeps_collectives: bool = False) -> None:
    """Checkpoint each decoder layer in `layers` with exact_checkpoint(checkpoint_fn) (or stop, enable=False)."""
    from .moe import SparseMoeBlock

    for layer in layers:
        moe = any(isinstance(m, SparseMoeBlock) for m in layer.modules())
        layer._gradient_checkpointing_func = exact_checkpoint(checkpoint_fn, traceable=not moe,
                                                              keeps_collectives=keeps_collectives)
        layer.gradient_checkpointing = enable


class GatedQwen3PreTrainedModel(PreTrainedModel):
    config_class = GatedQwen3Config
    config: GatedQwen3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GatedQwen3DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": GatedQwen3DecoderLayer, "attentions": GatedAttention}

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1):
        """transformers' `activation_checkpointing_enable()` lands here: its checkpoint function (with the user's
        kwargs) is wrapped so that the recompute replays the forward exactly (exact_checkpoint)."""
        fn = gradient_checkpointing_func or torch.utils.checkpoint.checkpoint
        super()._set_gradient_checkpointing(enable=enable, gradient_checkpointing_func=fn, every_n_layers=every_n_layers)
        layers = [m for m in self.modules() if isinstance(m, GradientCheckpointingLayer)]
        for layer in layers:  # the same choice of layers, each with its exact checkpoint function
            set_exact_checkpointing([layer], fn, enable=layer.gradient_checkpointing)

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, RotaryEmbedding):  # non-persistent buffers: recompute (from_pretrained builds on meta)
            inv_freq, _ = compute_rope_parameters(module.config)
            init.copy_(module.inv_freq, inv_freq)
            init.copy_(module.original_inv_freq, inv_freq)
        elif isinstance(module, AttentionMechanism):
            module.init_parameters(self.config.initializer_range)  # its own Parameters (sinks, per-head gate)
        elif type(module).__name__ in ("MoeRouter", "MoeExperts"):  # 3-D expert weights / router: N(0, std)
            for p in module.parameters(recurse=False):
                init.normal_(p, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, Gate) and module.spec.source is Source.CONSTANT:
            init.zeros_(module.theta)  # the paper's input-independent gate starts at theta = 0
        elif isinstance(module, nn.Linear) and getattr(module, "_zero_init", False):
            init.zeros_(module.weight)  # identity-at-start gate (gate_init="identity"): score = 1 exactly
            if module.bias is not None:
                init.zeros_(module.bias)
        else:
            super()._init_weights(module)


class GatedQwen3Model(GatedQwen3PreTrainedModel):
    def __init__(self, config: GatedQwen3Config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(GatedQwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        if "past_key_values" in kwargs:  # the pre-5.x name, still sent by some callers
            cache = kwargs.pop("past_key_values") if cache is None else cache
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, d)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past).unsqueeze(0)
        layer_types = self.config.layer_types[: self.config.num_hidden_layers]
        if isinstance(attention_mask, dict):  # ready masks by layer type (generate, decode.py)
            masks = attention_mask
            missing = sorted(set(layer_types) - set(masks))
            if missing:
                raise ValueError(f"attention_mask dict lacks masks for layer types {missing}; pass one per type in "
                                 f"config.layer_types, or a plain (B, S) padding mask")
        else:
            mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               cache=cache, position_ids=position_ids)
            masks = {}
            if "full_attention" in layer_types:
                masks["full_attention"] = create_causal_mask(**mask_kwargs)
            if "sliding_attention" in layer_types:  # Mistral / Qwen2 windows: keys within sliding_window of the query
                masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer, layer_type in zip(self.layers[: self.config.num_hidden_layers], layer_types):
            hidden_states = layer(hidden_states, attention_mask=masks[layer_type],
                                  position_embeddings=position_embeddings, cache=cache, position_ids=position_ids,
                                  **kwargs)
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None)


class GatedQwen3ForCausalLM(GatedQwen3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: GatedQwen3Config):
        super().__init__(config)
        self.model = GatedQwen3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache: Cache | None = None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0,
                fused_loss: bool = False, loss_reduction: str = "mean", **kwargs) -> MoeCausalLMOutputWithPast:
        """fused_loss=True with labels (or shift_labels=, already aligned): the loss comes from fused.chunked_lm_loss,
        which never materialises the (B, T, V) logits; `logits` is then None. loss_reduction="none" (no gradient):
        `loss` is each position's cross-entropy (B, T), the auxiliary loss left out (evaluation)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        fused = fused_loss and (labels is not None or kwargs.get("shift_labels") is not None)
        if fused and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("fused_loss=True scores every position; drop logits_to_keep (or set fused_loss=False)")
        logits = None if fused else self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = aux_loss = None  # logits: (B, T', V)
        if self.config.num_experts > 0:
            from .moe import collect_aux_loss

            aux_loss = collect_aux_loss(self)
        if fused:
            from .fused import chunked_lm_loss, shift_for_loss

            targets = kwargs.get("shift_labels")
            targets = shift_for_loss(labels) if targets is None else targets  # (B, T)
            loss = chunked_lm_loss(out.last_hidden_state, self.lm_head.weight, targets,
                                   num_items_in_batch=kwargs.get("num_items_in_batch"), reduction=loss_reduction)
            if aux_loss is not None and loss_reduction == "mean":
                loss = loss + aux_loss.to(loss.device)
        elif labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if aux_loss is not None:
                loss = loss + aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                         cache=out.cache, hidden_states=out.hidden_states,
                                         attentions=out.attentions)


__all__ = ["GatedQwen3Model", "GatedQwen3ForCausalLM", "GatedQwen3PreTrainedModel"]


# the Auto classes find model_type "gated_qwen3" once the model is importable (package docstring)
AutoConfig.register(GatedQwen3Config.model_type, GatedQwen3Config, exist_ok=True)
AutoModel.register(GatedQwen3Config, GatedQwen3Model, exist_ok=True)
AutoModelForCausalLM.register(GatedQwen3Config, GatedQwen3ForCausalLM, exist_ok=True)
