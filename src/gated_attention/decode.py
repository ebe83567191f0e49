"""A lean decode loop: `generate_fast(model, input_ids, max_new_tokens, ...)`, greedy or sampling, with a static KV
cache, optionally a torch.compile'd single-token step.

Why: on small models `model.generate` spends most of each token in GenerationMixin (logits processors, stopping
criteria, cache bookkeeping, mask building), not in the model. This loop keeps only what a decode needs: one
preallocated (B, KV, S_max, D) cache per layer written in place, a boolean key mask built once and sliced per step
(passed to the model as a ready mask, so `create_causal_mask` is skipped), positions counted as transformers counts
them for left padding (cumsum of the attention mask - 1), logits of the last position only. Greedy output equals
`model.generate(..., do_sample=False)` token for token (tests/test_decode.py), left-padded batches included.
"""
from __future__ import annotations

import torch
from torch import nn


class StaticKVCache:
    """Preallocated keys/values per layer, (B, KV, S_max, D); `pos` (a LongTensor of the slots the current forward
    writes) is set by the loop before each call, so a compiled step sees the same shapes every token."""

    def __init__(self, config, batch: int, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (batch, config.num_key_value_heads, max_len, config.head_dim)  # (B, KV, S_max, D)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.pos = torch.zeros(0, dtype=torch.long, device=device)
        self.length = 0  # slots filled so far (same for every row: left padding keeps rows aligned)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write k/v (B, KV, T, D) at slots `pos`; returns the whole buffers (unwritten slots are masked out)."""
        self.keys[layer_idx].index_copy_(2, self.pos, k.to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(2, self.pos, v.to(self.values[layer_idx].dtype))
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length


def _check_model(model: nn.Module) -> None:
    for mod in model.modules():
        if getattr(mod, "baseline", None) is not None:
            raise ValueError(f"generate_fast: attention baseline {type(mod.baseline).__name__} may change the cache "
                             f"layout or the mask; use model.generate for it")
    if model.config._attn_implementation not in (None, "sdpa", "eager"):
        raise ValueError(f"generate_fast supports the sdpa and eager kernels, not "
                         f"{model.config._attn_implementation!r}; call model.set_attn_implementation('sdpa')")


def _eos_ids(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None or eos_token_id is False:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator) -> torch.Tensor:
    """Next token per row from logits (B, V): temperature, then top-k, then nucleus (top-p), then a multinomial draw."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(1)  # (B,)


@torch.no_grad()
def generate_fast(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                  attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
                  pad_token_id: int | None = None, stop_at_eos: bool = True, compile_step: bool = False,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue `input_ids` (B, P) by up to `max_new_tokens`; returns (B, P + n) like `model.generate`.

    attention_mask (B, P): 1 for tokens, 0 for LEFT padding. Rows that emit an EOS (model.generation_config's unless
    `eos_token_id` is given) are padded with `pad_token_id` afterwards; the loop stops when every row has finished
    (`stop_at_eos=False` always runs max_new_tokens, like generate's min_new_tokens). `compile_step=True` compiles the
    single-token step once (fixed shapes: it pays off only for long generations)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling (got {temperature}); use do_sample=False for greedy")
    _check_model(model)
    was_training = model.training
    model.eval()
    b, p = input_ids.shape
    dev = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif bool((attention_mask[:, -1] == 0).any()):
        raise ValueError("generate_fast expects LEFT padding (the last prompt column must be a real token in every "
                         "row); pad on the left, e.g. tokenizer.padding_side = 'left'")
    eos = _eos_ids(model, eos_token_id) if stop_at_eos else []
    if pad_token_id is None:
        pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else (eos[0] if eos else 0)
    s_max = p + max_new_tokens
    dtype = next(model.parameters()).dtype
    cache = StaticKVCache(model.config, b, s_max, dtype, dev)
    keys_ok = torch.ones(b, s_max, dtype=torch.bool, device=dev)  # (B, S_max): False on padding slots
    keys_ok[:, :p] = attention_mask.bool()
    slots = torch.arange(s_max, device=dev)
    # transformers' positions for left padding: count only real tokens; padding rows get 1 (their value is unused)
    pos_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # (B, P)

    # prefill: causal over the prompt, padding keys hidden; every query also sees itself so a padding row never
    # softmaxes over nothing (a NaN there would reach real rows through 0 * NaN in probs @ V)
    causal = slots[None, :] <= torch.arange(p, device=dev)[:, None]  # (P, S_max)
    mask = (causal[None] & keys_ok[:, None, :]) | (slots[None, None, :] == torch.arange(p, device=dev)[None, :, None])
    cache.pos = torch.arange(p, device=dev)
    out = model(input_ids=input_ids, attention_mask={"full_attention": mask[:, None]}, position_ids=pos_ids,
                cache=cache, use_cache=True, logits_to_keep=1)  # mask (B, 1, P, S_max)
    cache.length = p
    logits = out.logits[:, -1]  # (B, V)

    def step(tok, pos, slot, key_mask):
        cache.pos = slot
        o = model(input_ids=tok, attention_mask={"full_attention": key_mask}, position_ids=pos, cache=cache,
                  use_cache=True, logits_to_keep=1)
        return o.logits[:, -1]  # (B, V)

    run_step = torch.compile(step, dynamic=False) if compile_step else step
    next_pos = pos_ids[:, -1:] + 1  # (B, 1)
    finished = torch.zeros(b, dtype=torch.bool, device=dev)
    new = []
    for i in range(max_new_tokens):
        tok = _sample(logits, temperature, top_k, top_p, generator) if do_sample else logits.argmax(-1)  # (B,)
        tok = torch.where(finished, torch.full_like(tok, pad_token_id), tok)
        new.append(tok)
        if eos:
            finished |= torch.isin(tok, torch.tensor(eos, device=dev))
            if bool(finished.all()):
                break
        if i == max_new_tokens - 1:
            break
        slot = p + i
        key_mask = (keys_ok & (slots <= slot))[:, None, None, :]  # (B, 1, 1, S_max)
        logits = run_step(tok[:, None], next_pos, torch.tensor([slot], device=dev), key_mask)
        cache.length = slot + 1
        next_pos = next_pos + 1
    model.train(was_training)
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)  # (B, P + n)


__all__ = ["generate_fast", "StaticKVCache"]
