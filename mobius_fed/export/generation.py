"""Sampling with a KV cache and text evaluation for exported models.

Tokens come from the run's encoding (``config.json``'s ``encoding``: ``bytes`` or
tiktoken's ``gpt2``), so a prompt is read exactly as the training text was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mobius_fed.export.modeling_mobius import KVCache, MobiusLM


def encoding_of(model: MobiusLM):
    """The tiktoken encoding the model was trained with."""
    from mobius_fed.data.tokenizers import get_encoding

    return get_encoding(model.mobius.get("encoding", "bytes"))


class Decoder:
    """Feeds tokens to ``model`` one call at a time, keeping the keys/values of every
    (application, block) so each new token costs one position, not the whole sequence.

    The private home layer ``block`` attends over the sequence: its input (the final
    hidden states) is kept and it reruns on all of it. Past the context ``seq_len`` the
    cache restarts from the newest half of the tokens (positions are absolute in RoPE).
    """

    def __init__(self, model: MobiusLM) -> None:
        self.model = model
        self.tokens: list[int] = []
        self.cache: KVCache | None = None
        self.hidden: Tensor | None = None  # final hidden states (home layer ``block``)

    @torch.no_grad()
    def feed(self, new: list[int]) -> Tensor:
        """Logits [V] of the token after ``tokens + new``."""
        if len(self.tokens) + len(new) > self.model.seq_len:
            window = (self.tokens + new)[-max(1, self.model.seq_len // 2) :]
            self.tokens, self.cache, self.hidden = [], None, None
            return self.feed(window)
        device = self.model.wte.weight.device
        idx = torch.tensor([new], dtype=torch.long, device=device)
        h, self.cache = self.model.hidden_and_cache(idx, self.cache)
        self.tokens += new
        if self.model.cached_home:
            return self.model.head(h[:, -1:])[0, -1]
        self.hidden = h if self.hidden is None else torch.cat((self.hidden, h), 1)
        return self.model.head(self.hidden)[0, -1]  # the home block attends over all of it


def pick(logits: Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / T) over the top k."""
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(f"temperature must be >= 0 and top_k >= 1 (got {temperature}, {top_k})")
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = F.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=gen))


def generate_ids(
    model: MobiusLM,
    prompt: list[int],
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    stop: int | None = None,
    vocab: int | None = None,
) -> list[int]:
    """New token ids after ``prompt`` (same seed, same ids); ends early at ``stop``. Only
    ids below ``vocab`` are drawn (the model's table is padded past the encoding's)."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0 (got {max_new_tokens})")
    gen = torch.Generator().manual_seed(seed)
    dec, out = Decoder(model), []
    logits = dec.feed(list(prompt))
    for _ in range(max_new_tokens):
        tok = pick(logits[:vocab], temperature, top_k, gen)
        if tok == stop:
            break
        out.append(tok)
        logits = dec.feed([tok])
    return out


def generate_text(model: MobiusLM, prompt: str, **kwargs) -> str:
    """``prompt`` continued by :func:`generate_ids`, tokenized with the run's encoding."""
    enc = encoding_of(model)
    ids = enc.encode_ordinary(prompt) or [enc.eot_token]  # an empty prompt: a new document
    new = generate_ids(model, ids, stop=enc.eot_token, vocab=enc.n_vocab, **kwargs)
    return enc.decode(new)


@dataclass
class TextScore:
    """Mean next-token loss (nats) over ``tokens`` predictions, and its perplexity."""

    tokens: int
    loss: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def score_text(model: MobiusLM, text: str) -> TextScore:
    """Loss and perplexity of ``text`` (one document: its tokens, then end-of-text) in
    consecutive windows of ``seq_len`` predictions, every token predicted once."""
    enc = encoding_of(model)
    ids = [*enc.encode_ordinary(text), enc.eot_token]
    if len(ids) < 2:
        raise ValueError("the text is empty: nothing to predict")
    T = model.seq_len
    total, count = 0.0, 0
    device = model.wte.weight.device
    for s in range(0, len(ids) - 1, T):
        chunk = torch.tensor(ids[s : s + T + 1], device=device)
        logits = model(chunk[None, :-1])[0]
        total += float(F.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += chunk.numel() - 1
    return TextScore(tokens=count, loss=total / count)
