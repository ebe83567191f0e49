"""The Bigram-Backcopy task (Guo et al. 2024, "Active-Dormant Attention Heads", arXiv 2410.13835).

Token ids: 0 is BOS, 1..V are the normal tokens. Every sequence starts with BOS. The other tokens follow a fixed,
seeded first-order Markov chain over the V normal tokens, except after a *trigger* token (k of the normal tokens):
there the next token copies the token before the trigger ("backcopy"). So

    x_0 = BOS,  x_1 ~ pi (the chain's stationary distribution, restricted to non-triggers),
    x_{t+1} = x_{t-1}                 if x_t is a trigger  (t >= 2 always holds: x_1 is never a trigger)
    x_{t+1} ~ P[x_t, :]               otherwise.

A copied token that is itself a trigger triggers again (the rule is applied at every position, no exceptions).
A one-layer model solves the backcopy with one head that attends from the trigger to the previous token; on every
other query that head has nothing to do ("dormant"). Softmax makes it put that probability somewhere: on BOS, a
sink. Prediction positions are split into:

    backcopy positions  query x_t is a trigger; the target x_{t+1} = x_{t-1} is deterministic (ideal CE 0)
    bigram positions    t >= 1 and x_t is not a trigger; ideal CE = the entropy of row P[x_t] (the floor)

(the BOS query t = 0 predicts x_1 from nothing and belongs to neither). The transition rows are Dirichlet(alpha)
draws from the task seed; triggers are the k most frequent tokens under pi, so every sequence holds several.
A batch is a pure function of (task, seed, step): data order needs no state, and every variant sees the same tokens.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cached_property

# torch is imported inside the methods that compute: the task's settings (a lab budget's defaults) load without it

BOS = 0


@dataclass(frozen=True)
class BackcopyTask:
    vocab: int = 64  # V normal tokens (ids 1..V); the model's vocabulary is V + 1 with BOS
    triggers: int = 3  # k trigger tokens among the normal ones
    seq_len: int = 128  # model input length T (BOS included); a sample holds T + 1 tokens (inputs + shifted targets)
    alpha: float = 0.3  # Dirichlet concentration of each transition row: lower = more predictable bigrams
    seed: int = 0  # the chain and the triggers (not the data order: that is the run seed's)

    def __post_init__(self):
        if self.vocab < 2 or not 1 <= self.triggers < self.vocab:
            raise ValueError(f"Bigram-Backcopy needs vocab >= 2 and 1 <= triggers < vocab; got vocab={self.vocab}, "
                             f"triggers={self.triggers}")
        if self.seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 (BOS, a token, a trigger); got {self.seq_len}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0; got {self.alpha}")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def model_vocab(self) -> int:
        return self.vocab + 1

    @cached_property
    def transition(self) -> torch.Tensor:
        """P (V+1, V+1) float64 over model ids; row/column 0 (BOS) unused: BOS never follows and is never followed
        by the chain. Rows of normal tokens are Dirichlet(alpha) over the normal tokens."""
        import torch

        g = torch.Generator().manual_seed(self.seed)
        gam = torch._standard_gamma(torch.full((self.vocab, self.vocab), float(self.alpha), dtype=torch.float64),
                                    generator=g)  # (V, V) gamma draws -> Dirichlet rows
        gam = gam.clamp_min(1e-300)
        P = torch.zeros(self.model_vocab, self.model_vocab, dtype=torch.float64)
        P[1:, 1:] = gam / gam.sum(1, keepdim=True)
        return P

    @cached_property
    def stationary(self) -> torch.Tensor:
        """pi (V+1,) of the plain chain (power iteration; pi[BOS] = 0)."""
        import torch

        P = self.transition[1:, 1:]
        pi = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(2000):
            nxt = pi @ P
            if float((nxt - pi).abs().max()) < 1e-13:
                pi = nxt
                break
            pi = nxt
        return torch.cat([torch.zeros(1, dtype=torch.float64), pi / pi.sum()])

    @cached_property
    def trigger_ids(self) -> torch.Tensor:
        """(k,) model ids of the trigger tokens: the k most frequent under pi (ties broken by id)."""
        import torch

        order = sorted(range(1, self.model_vocab), key=lambda i: (-float(self.stationary[i]), i))
        return torch.tensor(sorted(order[: self.triggers]), dtype=torch.long)

    @cached_property
    def is_trigger(self) -> torch.Tensor:
        """(V+1,) bool lookup table."""
        import torch

        t = torch.zeros(self.model_vocab, dtype=torch.bool)
        t[self.trigger_ids] = True
        return t

    @cached_property
    def row_entropy(self) -> torch.Tensor:
        """(V+1,) entropy in nats of each row of P (0 for BOS)."""
        import torch

        P = self.transition
        return -(P * torch.log(P.clamp_min(1e-300))).sum(1)

    def sample(self, batch_size: int, seed: int) -> torch.Tensor:
        """(B, T+1) token ids, a pure function of (task, batch_size, seed)."""
        import torch

        g = torch.Generator().manual_seed(int(seed))
        B, n = batch_size, self.seq_len + 1
        out = torch.empty(B, n, dtype=torch.long)
        out[:, 0] = BOS
        first = self.stationary.clone()
        first[self.trigger_ids] = 0.0  # x_1 has no token before it to copy
        cdf_first = (first / first.sum()).cumsum(0)
        cdf = self.transition.cumsum(1)  # (V+1, V+1)
        u = torch.rand(n, B, 1, generator=g, dtype=torch.float64)  # inverse-CDF sampling: one uniform per position
        out[:, 1] = torch.searchsorted(cdf_first, u[1]).squeeze(1).clamp(1, self.vocab)
        trig = self.is_trigger
        for t in range(1, n - 1):
            cur = out[:, t]
            nxt = torch.searchsorted(cdf[cur], u[t + 1]).squeeze(1).clamp(1, self.vocab)  # (B,)
            out[:, t + 1] = torch.where(trig[cur], out[:, t - 1], nxt)
        return out

    def train_batch(self, batch_size: int, seed: int, step: int) -> torch.Tensor:
        return self.sample(batch_size, seed * 1_000_003 + step)

    def eval_set(self, n: int) -> torch.Tensor:
        """Held-out sequences (B, T+1) from a seed range no training batch uses (training seeds are >= 0)."""
        return self.sample(n, -(10 ** 9))

    def masks(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Query-position masks (B, T) bool of model inputs (B, T): active = trigger queries (their next token is a
        backcopy), dormant = every other query but BOS's (their next token is a bigram draw)."""
        import torch

        trig = self.is_trigger[inputs]
        not_bos = torch.ones_like(trig)
        not_bos[:, 0] = False
        return {"active": trig & not_bos, "dormant": ~trig & not_bos}

    def bigram_floor(self, inputs: torch.Tensor, dormant: torch.Tensor) -> float:
        """Mean true conditional entropy (nats) over bigram positions: the CE a perfect model reaches there."""
        ent = self.row_entropy[inputs]  # (B, T)
        n = int(dormant.sum())
        return float((ent * dormant).sum() / n) if n else math.nan
