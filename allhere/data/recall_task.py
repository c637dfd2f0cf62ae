"""A synthetic long-range recall task: key/value facts early, queries far beyond any small window.

Layout of one sequence of ``seq_len`` tokens:
    BOS  [k1=v1] [k2=v2] ... [kP=vP]  filler ...  SEP  ka va kb vb ... (Q queries)
Each fact ``[k=v]`` is one token (one id per (key, value) combination), so a single attention hop from
a query key to its fact answers it: the task measures *reaching back*, not the slow-to-learn two-hop
induction circuit that separate key and value tokens would need.
The filler continues a counting pattern (next = previous + 1 mod F, restarted at random 10% of the
time), so local context predicts it well and no global context helps there. Each query repeats one of
the P keys; the token after it is that key's value, which only a head that reaches back to the start
can know. The positions holding a query key (whose next token is the value) are the *retrieval*
tokens. Chance accuracy on them is 1 / n_values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validation import ConfigError

BOS, SEP = 0, 1


@dataclass(frozen=True)
class RecallTask:
    seq_len: int = 192  # tokens per sequence
    n_pairs: int = 8  # key/value pairs stated at the start (P)
    n_queries: int = 8  # queries at the end (Q <= P, each key asked at most once)
    n_keys: int = 8  # key alphabet
    n_values: int = 16  # value alphabet (chance accuracy = 1 / n_values)
    n_filler: int = 32  # filler alphabet

    def __post_init__(self) -> None:
        if not 1 <= self.n_queries <= self.n_pairs <= self.n_keys:
            raise ConfigError(f"RecallTask needs 1 <= n_queries <= n_pairs <= n_keys, got {self}")
        if self.filler_len < 1:
            raise ConfigError(f"RecallTask.seq_len = {self.seq_len} is too short for {self.n_pairs} pairs "
                              f"and {self.n_queries} queries")

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_keys + self.n_values + self.n_filler + self.n_keys * self.n_values

    @property
    def filler_len(self) -> int:
        return self.seq_len - 1 - self.n_pairs - 1 - 2 * self.n_queries

    @property
    def min_distance(self) -> int:
        """Fewest tokens between a query and the pair it asks about."""
        return self.filler_len + 2

    def token_name(self, t: int) -> str:
        """A readable name of token id ``t`` (for pages and plots)."""
        k0, v0, f0 = 2, 2 + self.n_keys, 2 + self.n_keys + self.n_values
        p0 = f0 + self.n_filler
        if t in (BOS, SEP):
            return "<BOS>" if t == BOS else "\n<SEP> "
        if t < v0:
            return f"k{t - k0} "
        if t < f0:
            return f"v{t - v0} "
        if t < p0:
            return f"f{t - f0} "
        return f"[k{(t - p0) // self.n_values}=v{(t - p0) % self.n_values}] "

    def batch(self, batch: int, generator: torch.Generator, filler_len: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ids [batch, seq_len] int64 and retrieval [batch, seq_len] bool (query-key positions).

        ``filler_len`` shortens the filler (and so the sequence) for a curriculum; default: full length.
        """
        fl = self.filler_len if filler_len is None else filler_len
        k0, v0, f0 = 2, 2 + self.n_keys, 2 + self.n_keys + self.n_values
        p0 = f0 + self.n_filler
        keys = torch.rand(batch, self.n_keys, generator=generator).argsort(-1)[:, : self.n_pairs]
        vals = torch.randint(0, self.n_values, (batch, self.n_pairs), generator=generator)
        facts = p0 + keys * self.n_values + vals
        keys, vals = keys + k0, vals + v0
        restart = torch.rand(batch, fl, generator=generator) < 0.1
        restart[:, 0] = True
        jumps = torch.randint(0, self.n_filler, (batch, fl), generator=generator)
        filler = torch.empty(batch, fl, dtype=torch.long)
        cur = jumps[:, 0]
        for t in range(fl):
            cur = torch.where(restart[:, t], jumps[:, t], (cur + 1) % self.n_filler)
            filler[:, t] = cur
        ask = torch.rand(batch, self.n_pairs, generator=generator).argsort(-1)[:, : self.n_queries]
        queries = torch.stack([keys.gather(1, ask), vals.gather(1, ask)], dim=-1).flatten(1)
        col = lambda v: torch.full((batch, 1), v, dtype=torch.long)  # noqa: E731
        ids = torch.cat([col(BOS), facts, filler + f0, col(SEP), queries], dim=1)
        retrieval = torch.zeros_like(ids, dtype=torch.bool)
        q_start = ids.shape[1] - 2 * self.n_queries
        retrieval[:, q_start::2] = True
        return ids, retrieval

    def training_batch(self, batch: int, generator: torch.Generator, curriculum: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, loss_mask): the loss counts only the answers (the value after each query key); the
        rest is random facts and keys, or trivial filler, whose loss would drown the recall signal.

        ``curriculum``: the filler length is drawn uniformly from 1 to the full length for the whole
        batch; near facts give attention a strong gradient towards them, far ones teach it to reach.
        """
        fl = int(torch.randint(1, self.filler_len + 1, (1,), generator=generator)) if curriculum else None
        ids, retrieval = self.batch(batch, generator, filler_len=fl)
        loss_mask = torch.zeros_like(retrieval)
        loss_mask[:, 1:] = retrieval[:, :-1]
        return ids, loss_mask
