"""A lean decode loop: `generate_fast(model, input_ids, max_new_tokens, ...)`, greedy or sampling, with a static KV
cache, optionally a torch.compile'd single-token step.

Why: on small models `model.generate` spends most of each token in GenerationMixin (logits processors, stopping
criteria, cache bookkeeping, mask building), not in the model. This loop keeps only what a decode needs: one
preallocated (B, KV, S_max, D) cache per layer written in place, a boolean key mask built once and sliced per step
(passed to the model as a ready mask, so `create_causal_mask` is skipped), positions counted as transformers counts
them for left padding (cumsum of the attention mask - 1), logits of the last position only. Greedy output equals
`model.generate(..., do_sample=False)` token for token (tests/test_decode.py), left-padded batches included.

Streaming (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453): `window=W, sink_tokens=K` decodes with a rolling KV
cache (`SinkWindowCache`) that keeps the first K tokens forever plus the last W tokens (the current one included), so
memory stays flat however long the stream; K = 0 is a plain sliding window. Positions are StreamingLLM's: positions
*within the cache*, not in the text. A query sits at its cache slot (at most K + W - 1), the K sink tokens at 0..K-1,
the window tokens at K..K+W-1 in order, so RoPE never sees a position past K + W - 1 however long the stream is;
attention from the newest token to a window token keeps its true distance, to a sink token j it is K + W - 1 - j.
Keys are cached as the model rotated them when written and re-rotated on read by the shift since (a pure rotation,
one per key and step, never accumulated). `stream_logits` runs a whole sequence through that cache (teacher forcing)
and returns every position's logits: the evaluation of `gattn lab streaming`.
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


class SinkWindowCache:
    """StreamingLLM's rolling KV cache: slots 0..K-1 hold the first K tokens forever, slots K..K+W-1 a ring buffer of
    the last W tokens; (B, KV, K+W, D) per layer, allocated once. The loop calls `plan(n_new)` before each forward:
    it picks the slots the new tokens overwrite, their positions (cache positions, see the module docstring) and the
    rotation that moves every kept key to its current position; `update` (called by each layer) writes and reads."""

    def __init__(self, model: nn.Module, batch: int, window: int, sink_tokens: int, dtype: torch.dtype,
                 device: torch.device):
        config = model.config
        if window < 1 or sink_tokens < 0:
            raise ValueError(f"streaming needs window >= 1 and sink_tokens >= 0; got window={window}, "
                             f"sink_tokens={sink_tokens}")
        rope = model.model.rotary_emb
        if rope.rope_type in ("dynamic", "longrope") and window + sink_tokens > config.max_position_embeddings:
            raise ValueError(f"rope_type {rope.rope_type!r} changes its frequencies past max_position_embeddings "
                             f"({config.max_position_embeddings}); use window + sink_tokens <= that")
        self.window, self.sink_tokens = window, sink_tokens
        self.capacity = c = window + sink_tokens
        shape = (batch, config.num_key_value_heads, c, config.head_dim)  # (B, KV, K+W, D)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.inv_freq = rope.inv_freq.to(device=device, dtype=torch.float32)  # (rot/2,)
        self.slot_token = torch.full((c,), -1, dtype=torch.long, device=device)  # stream index held by each slot
        self.slot_written_at = torch.zeros(c, dtype=torch.long, device=device)  # position its key was rotated at
        self.seen = 0  # tokens written so far
        self.pos = torch.zeros(0, dtype=torch.long, device=device)  # slots the current forward writes
        self._rot = None  # (cos, sin) per slot, (1, 1, C, rot), when some kept key must move; None = no shift

    def position_of(self, token: torch.Tensor, seen: int) -> torch.Tensor:
        """Cache position of stream token(s) `token` once `seen` tokens have been written: sinks keep theirs, the
        window is shifted down by the number of tokens evicted so far."""
        evicted = max(0, seen - self.capacity)
        return torch.where(token < self.sink_tokens, token, token - evicted)

    def plan(self, n_new: int) -> torch.Tensor:
        """Choose slots for the next n_new tokens (several only while nothing is evicted: a prefill) and return
        their positions (n_new,) to pass as position_ids."""
        first, dev = self.seen, self.slot_token.device
        if n_new > 1 and first + n_new > self.capacity:
            raise ValueError(f"a forward of {n_new} tokens would evict within itself (cache {self.capacity}, "
                             f"{first} written); feed tokens past the cache one at a time")
        tok = torch.arange(first, first + n_new, device=dev)  # stream indices of the new tokens
        ring = self.sink_tokens + (tok - self.sink_tokens) % self.window
        self.pos = torch.where(tok < self.sink_tokens, tok, ring)
        seen = first + n_new
        new_pos = self.position_of(tok, seen)
        self.slot_token[self.pos] = tok
        self.slot_written_at[self.pos] = new_pos
        self.seen = seen
        held = self.slot_token >= 0
        shift = torch.where(held, self.position_of(self.slot_token, seen) - self.slot_written_at, 0)  # (C,) <= 0
        if bool((shift != 0).any()):
            freqs = shift[:, None].float() * self.inv_freq[None, :]  # (C, rot/2): a pure rotation, no YaRN scale
            emb = torch.cat((freqs, freqs), dim=-1)[None, None]  # (1, 1, C, rot)
            self._rot = (emb.cos(), emb.sin())
        else:
            self._rot = None
        return new_pos

    def key_mask(self, n_new: int) -> torch.Tensor:
        """(1, 1, n_new, C) bool: each new token sees the slots written so far, itself included (causal within a
        prefill)."""
        slots_tok = self.slot_token  # (C,)
        tok = torch.arange(self.seen - n_new, self.seen, device=slots_tok.device)  # (n_new,)
        return ((slots_tok[None, :] >= 0) & (slots_tok[None, :] <= tok[:, None]))[None, None]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write k/v (B, KV, T, D) at the planned slots; return all slots' keys at their current positions."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_copy_(2, self.pos, k.to(keys.dtype))
        values.index_copy_(2, self.pos, v.to(values.dtype))
        if self._rot is None:
            return keys, values
        from .rope import rotate_half

        cos, sin = self._rot
        rot = cos.shape[-1]
        # every key written at its position then, moved to its position now; the stored key stays as written so a
        # key is rotated from its write position each time (no drift from repeated rotations)
        moved = (keys[..., :rot].float() * cos + rotate_half(keys[..., :rot].float()) * sin).to(keys.dtype)
        if rot < keys.shape[-1]:  # partial RoPE: the other dims carry no position
            moved = torch.cat((moved, keys[..., rot:]), dim=-1)
        return moved, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return min(self.seen, self.capacity)

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (constant over a stream: the memory claim the tests check)."""
        ts = [*self.keys, *self.values, self.slot_token, self.slot_written_at]
        return sum(t.numel() * t.element_size() for t in ts)


def _check_model(model: nn.Module) -> None:
    for mod in model.modules():
        if getattr(mod, "mechanism", None) is not None:
            raise ValueError(f"generate_fast: comparison mechanism {type(mod.mechanism).__name__} may change the cache "
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


def _stream_forward(model: nn.Module, cache: SinkWindowCache, ids: torch.Tensor, logits_to_keep: int = 0):
    """One forward of ids (B, n) through a SinkWindowCache: plan the slots, pass cache positions and the slot mask."""
    pos = cache.plan(ids.shape[1])  # (n,)
    mask = cache.key_mask(ids.shape[1])  # (1, 1, n, C)
    out = model(input_ids=ids, attention_mask={"full_attention": mask}, position_ids=pos[None].expand(ids.shape[0], -1),
                cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits  # (B, n', V)


def _stream_chunks(model: nn.Module, input_ids: torch.Tensor, window: int, sink_tokens: int,
                   cache: SinkWindowCache | None = None):
    """Yield (start, logits (B, n, V)) over a whole sequence streamed through a SinkWindowCache (a fresh one unless
    given): the first K + W tokens in one forward (nothing is evicted yet, so that is exact), then one at a time."""
    _check_model(model)
    b, t = input_ids.shape
    if cache is None:
        cache = SinkWindowCache(model, b, window, sink_tokens, next(model.parameters()).dtype, input_ids.device)
    first = min(t, cache.capacity)
    yield 0, _stream_forward(model, cache, input_ids[:, :first])
    for i in range(first, t):
        yield i, _stream_forward(model, cache, input_ids[:, i:i + 1])


@torch.no_grad()
def stream_logits(model: nn.Module, input_ids: torch.Tensor, window: int, sink_tokens: int = 4) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) of input_ids (B, T) decoded through the rolling window: position t is predicted
    from the first `sink_tokens` tokens and the last `window` tokens up to t (StreamingLLM cache positions)."""
    was_training = model.training
    model.eval()
    try:
        return torch.cat([lg for _, lg in _stream_chunks(model, input_ids, window, sink_tokens)], dim=1)
    finally:
        model.train(was_training)


@torch.no_grad()
def stream_nll(model: nn.Module, input_ids: torch.Tensor, window: int | None, sink_tokens: int = 4) -> torch.Tensor:
    """Per-position next-token loss (B, T-1), nats, of input_ids (B, T): entry t is -log p(x_{t+1} | context of t)
    with the rolling window, or with full attention when window is None. Never holds (B, T, V) logits at once
    past the first K + W positions."""
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    targets = input_ids[:, 1:]
    try:
        if window is None:
            logits = model(input_ids=input_ids[:, :-1]).logits  # (B, T-1, V)
            return F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")
        parts = []
        for start, lg in _stream_chunks(model, input_ids[:, :-1], window, sink_tokens):
            n = lg.shape[1]
            parts.append(F.cross_entropy(lg.float().transpose(1, 2), targets[:, start:start + n], reduction="none"))
        return torch.cat(parts, dim=1)  # (B, T-1)
    finally:
        model.train(was_training)


@torch.no_grad()
def generate_fast(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                  attention_mask: torch.Tensor | None = None, do_sample: bool = False, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, eos_token_id: int | list[int] | None = None,
                  pad_token_id: int | None = None, stop_at_eos: bool = True, compile_step: bool = False,
                  generator: torch.Generator | None = None, window: int | None = None,
                  sink_tokens: int = 4) -> torch.Tensor:
    """Continue `input_ids` (B, P) by up to `max_new_tokens`; returns (B, P + n) like `model.generate`.

    attention_mask (B, P): 1 for tokens, 0 for LEFT padding. Rows that emit an EOS (model.generation_config's unless
    `eos_token_id` is given) are padded with `pad_token_id` afterwards; the loop stops when every row has finished
    (`stop_at_eos=False` always runs max_new_tokens, like generate's min_new_tokens). `compile_step=True` compiles the
    single-token step once (fixed shapes: it pays off only for long generations).

    window=W: stream with a rolling KV cache that keeps the first `sink_tokens` (K, default 4 as in StreamingLLM; 0 =
    a plain sliding window) plus the last W tokens, at cache positions (module docstring); memory stays that of
    K + W tokens however long the prompt and the generation. A prompt longer than K + W is fed through the same
    window. Needs unpadded rows."""
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
    if window is not None:
        if not bool(attention_mask.bool().all()):
            raise ValueError("generate_fast(window=...) streams unpadded rows only (the sink slots hold each row's "
                             "first tokens); generate padded prompts row by row")
        if compile_step:
            raise ValueError("compile_step is not supported with window= (the rolling cache re-plans every token)")
        cache = SinkWindowCache(model, b, window, sink_tokens, next(model.parameters()).dtype, dev)
        for _, lg in _stream_chunks(model, input_ids, window, sink_tokens, cache):  # the prompt: K + W tokens at
            logits = lg[:, -1]  # (B, V)                                           # once, the rest one by one

        def advance(tok, i):
            return _stream_forward(model, cache, tok[:, None], logits_to_keep=1)[:, -1]  # (B, V)
    else:
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
        next_pos = [pos_ids[:, -1:] + 1]  # (B, 1), in a list so advance can move it on

        def advance(tok, i):
            slot = p + i
            key_mask = (keys_ok & (slots <= slot))[:, None, None, :]  # (B, 1, 1, S_max)
            lg = run_step(tok[:, None], next_pos[0], torch.tensor([slot], device=dev), key_mask)
            cache.length = slot + 1
            next_pos[0] = next_pos[0] + 1
            return lg

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
        logits = advance(tok, i)
    model.train(was_training)
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)  # (B, P + n)


__all__ = ["generate_fast", "StaticKVCache", "SinkWindowCache", "stream_logits", "stream_nll"]
