"""Prompt-lookup speculative decoding for the continuous engine: drafts from the row's own tokens, verified exactly.

When few rows are in flight a decode step is bound by reading the weights once (about nine tenths of a
SmolLM2 step at one to three rows on CPU), so computing a few more positions in the same pass costs little.
A row whose last tokens (an n-gram of ``ngram_max`` down to ``ngram_min`` tokens) occurred earlier in its
prompt or output proposes the tokens that followed that occurrence (prompt lookup, the draft-model-free
proposer of vLLM's ``ngram`` method). The step's forward pass computes the row's last token and its draft
together; :func:`verify` keeps the longest prefix of the draft that the model itself would have produced and
adds one token from the model, so a step yields between 1 and ``draft + 1`` tokens per row.

Exactness: greedy rows keep a draft token only where it is the argmax, so their ids are those of decoding one
token at a time. Sampled rows use speculative sampling with a deterministic proposal: draft token ``d`` is
kept with probability ``p(d)`` (``p`` the distribution after temperature and top-p, the one the behaviour
log-probs describe), and on a rejection the token is drawn from ``p`` with ``d`` removed and renormalised, so
every emitted token is distributed exactly as ``p`` given the tokens before it. Each token's log-prob is
``log p(token)`` from the position that emitted it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Speculation:
    """How the continuous engine speculates (``models.<m>.rollouter.speculate``)."""

    draft_tokens: int = 8  # most draft tokens per row and step (0: off)
    max_rows: int = 4  # only while at most this many rows are in flight (a step bound by reading the weights)
    step_tokens: int = 16  # positions one speculating step computes: rows plus their drafts
    ngram_max: int = 3  # longest n-gram looked up
    ngram_min: int = 1  # shortest

    @property
    def on(self) -> bool:
        return self.draft_tokens > 0


OFF = Speculation(draft_tokens=0)


class PromptLookup:
    """An index of one row's tokens: for the current suffix of each n-gram length, where it last occurred before.

    :meth:`extend` is O(ngram lengths) per token; :meth:`draft` O(1).
    """

    __slots__ = ("seq", "last", "match", "nmin", "nmax")

    def __init__(self, tokens: list[int], nmin: int, nmax: int) -> None:
        self.seq: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> end index of its latest occurrence
        self.match: dict[int, int | None] = {}  # n -> end index of the previous occurrence of the current suffix
        self.nmin, self.nmax = nmin, nmax
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq, last, match = self.seq, self.last, self.match
        for t in tokens:
            seq.append(t)
            i = len(seq) - 1
            for n in range(self.nmin, self.nmax + 1):
                if n > i + 1:
                    match[n] = None
                    continue
                key = tuple(seq[i - n + 1 : i + 1])
                match[n] = last.get(key)
                last[key] = i

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        if k <= 0:
            return []
        for n in range(self.nmax, self.nmin - 1, -1):
            j = self.match.get(n)
            if j is not None:
                out = self.seq[j + 1 : j + 1 + k]
                if out:
                    return out
        return []


def verify(logp: torch.Tensor, argmax: list[int], draft: list[int], greedy: bool,
           generator: torch.Generator) -> tuple[list[int], list[float]]:
    """The tokens a row emits from positions ``0..len(draft)`` (``logp`` [len(draft) + 1, V]: each position's
    behaviour log-probs, ``argmax`` its argmax): the accepted prefix of ``draft`` and one token from the model.
    Returns the tokens and their log-probs."""
    tokens: list[int] = []
    for j, d in enumerate(draft):
        if greedy:
            ok = argmax[j] == d
        else:
            u = float(torch.rand((), generator=generator))
            ok = u < float(logp[j, d].exp())
        if ok:
            tokens.append(d)
            continue
        if greedy:
            t = argmax[j]
        else:  # the residual max(0, p - q) of a one-point proposal q: p without d, renormalised
            probs = logp[j].exp().clone()
            probs[d] = 0.0
            t = int(torch.multinomial(probs, 1, generator=generator)) if float(probs.sum()) > 0 else argmax[j]
        tokens.append(t)
        return tokens, [float(logp[i, x]) for i, x in enumerate(tokens)]
    k = len(draft)
    t = argmax[k] if greedy else int(torch.multinomial(logp[k].exp(), 1, generator=generator))
    tokens.append(t)
    return tokens, [float(logp[i, x]) for i, x in enumerate(tokens)]


__all__ = ["OFF", "PromptLookup", "Speculation", "verify"]
