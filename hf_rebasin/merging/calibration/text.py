"""Calibration text a model writes itself.

A user who moves a fine-tune rarely has its training data, but the fine-tune can write text like
it: sampled at temperature 1 from its own distribution, which is what distillation matches. A chat
model is started on the opening of a user turn through its own chat template (the template's text
up to where the user's words go: ``<|im_start|>user\\n`` for ChatML) and writes the user's words,
the end of the turn and the assistant's reply itself, as Magpie (Xu et al. 2024) builds chat data
from an aligned model with no prompts. A model without a template starts from its BOS (or EOS) token.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hf_rebasin.merging.calibration.vocab import Rows

__all__ = ["continued", "forward", "opening", "plain_start", "reply_tail", "self_written", "turn_end"]

_SENTINEL = "\x00user words\x00"


def opening(tokenizer: Any) -> tuple[list[int], str]:
    """The ids a written sample starts from, and what they are (for the card)."""
    around = _user_turn(tokenizer)
    if around is not None:
        head = around[0]
        ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        if ids:
            return list(ids), f"its chat template's user turn ({head!r})"
    return plain_start(tokenizer)


def reply_tail(tokenizer: Any) -> list[int]:
    """The template's ids from the end of a user's words to where the assistant's reply starts
    (``<|im_end|>\n<|im_start|>assistant\n`` for ChatML); none without a chat template."""
    around = _user_turn(tokenizer, reply=True)
    return list(tokenizer(around[1], add_special_tokens=False)["input_ids"]) if around is not None else []


def _user_turn(tokenizer: Any, *, reply: bool = False) -> tuple[str, str] | None:
    """The chat template's text before and after a user's words (``reply``: with the opening of
    the assistant's reply after them); None for a tokenizer without a template that renders one."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=reply
        )
    except Exception:  # a template that cannot render a user turn: no chat opening
        return None
    if not isinstance(text, str) or _SENTINEL not in text:
        return None
    at = text.index(_SENTINEL)
    return text[:at], text[at + len(_SENTINEL) :]


def plain_start(tokenizer: Any) -> tuple[list[int], str]:
    """Where plain text starts: the BOS token, else EOS (a model trained on documents joined by it)."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name, None)
        if isinstance(token, int):
            return [token], f"its {name.split('_')[0].upper()} token"
    return [0], "token 0 (the tokenizer names no BOS or EOS token)"


def turn_end(tokenizer: Any) -> int | None:
    """The token a chat template ends a turn with (``<|im_end|>``, ``<end_of_turn>``, ``<|eot_id|>``):
    the first special token after an assistant's words; None without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    words = "\x00assistant words\x00"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": words}], tokenize=False
        )
    except Exception:  # a template without an assistant turn: no turn end to measure
        return None
    if not isinstance(text, str) or words not in text:
        return None
    tail = text[text.index(words) + len(words) :]
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(
        getattr(tokenizer, "added_tokens_decoder", {}) or {}
    )
    for i in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if i in special:
            return int(i)
    return None


@torch.no_grad()
def self_written(
    model: Any,
    start: list[int],
    samples: int,
    length: int,
    *,
    seed: int,
    rows: Rows | None = None,
    batch_size: int = 32,
    progress: Callable[[int, int], None] | None = None,
) -> Tensor:
    """``samples`` sequences of ``length`` tokens sampled from ``model`` after ``start`` (temperature
    1, the whole distribution over the ``rows`` it has tokens for), deterministic under ``seed``;
    no early stop, so every sequence is full and a chat model writes turn after turn."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def sample(logits: Tensor) -> Tensor:
        probs = torch.softmax(logits, -1).cpu()
        return torch.multinomial(probs, 1, generator=gen).to(logits.device)

    out = []
    for i in range(0, samples, batch_size):
        n = min(batch_size, samples - i)
        out.append(_extend(model, torch.tensor([start] * n), length, rows, sample))
        if progress is not None:
            progress(i + n, samples)
    return torch.cat(out)


@torch.no_grad()
def continued(model: Any, prefix: Tensor, length: int, rows: Rows | None = None) -> Tensor:
    """``prefix`` (a batch of equal-length prefixes) continued greedily by ``model`` to ``length``
    tokens: the text the model itself writes, where its own mistakes (a loop, a turn never ended)
    show and can be corrected."""
    return _extend(model, prefix, length, rows, lambda logits: logits.argmax(-1, keepdim=True))


def _extend(model: Any, ids: Tensor, length: int, rows: Rows | None, pick: Callable[[Tensor], Tensor]) -> Tensor:
    """``ids`` extended token by token to ``length`` (the key/value cache kept), each next token
    chosen by ``pick`` from the logits over the ``rows`` the model has tokens for."""
    ids = ids.to(next(model.parameters()).device)
    step = forward(model, ids)
    while ids.shape[1] < length:
        logits = step.logits[:, -1].float()
        ids = torch.cat([ids, pick(rows.mask(logits) if rows is not None else logits)], 1)
        if ids.shape[1] < length:
            step = forward(model, ids[:, -1:], step)
    return ids.cpu()


def forward(model: Any, ids: Tensor, previous: Any = None) -> Any:
    """One forward pass that keeps its key/value cache, continuing ``previous``'s (transformers 5
    names it ``cache`` in newer models, ``past_key_values`` in others)."""
    if previous is None:
        return model(input_ids=ids, use_cache=True)
    key = _cache_argument(model)
    found = getattr(previous, "cache", None)
    return model(input_ids=ids, use_cache=True, **{key: found if found is not None else previous.past_key_values})


_CACHE_ARGUMENT: dict[type, str] = {}


def _cache_argument(model: Any) -> str:
    """The name a model's forward takes its cache by (read once per class, not per token)."""
    cls = type(model)
    if cls not in _CACHE_ARGUMENT:
        _CACHE_ARGUMENT[cls] = "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"
    return _CACHE_ARGUMENT[cls]
