"""Preference records -> token rows: TRL's preference formats rendered as TRL's `DPOTrainer`
renders them, so a pair trains on the tokens it would train on there.

Formats (each record one pair; every record of a dataset of one kind):

    conversational  {"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}
    standard        {"prompt": str, "chosen": str, "rejected": str}
    implicit prompt {"chosen": ..., "rejected": ...}: both hold the whole exchange; the prompt is
                    their longest shared prefix (messages, or characters backed off one space:
                    TRL's `extract_prompt`)

Tokens (TRL's `DPOTrainer._prepare_dataset`):

    conversational  prompt = render(prompt, add_generation_prompt=True), the row =
                    render(prompt + chosen) (the chat template through `data.chat.ChatRenderer`);
                    the completion is the row's text after the prompt's, which must be a prefix
                    of it (else one error naming the record)
    standard        the tokenizer's EOS text appended to each completion that lacks it; prompt =
                    the prompt string, the row = prompt + completion, tokenized with the
                    tokenizer's own special tokens (a Llama tokenizer's BOS), as TRL does

Both rows are tokenized whole, and the completion is the row's tokens after the prompt's. The
prompt's tokens are then the same in the chosen and the rejected row (the DPO loss compares
two completions of one prompt); where a tokenizer merges the prompt's last characters with the
completion's first (the prompt's tokens not a prefix of the row's: TRL only warns), the
completion is tokenized on its own after the prompt's tokens instead, and counted.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cephalo.data.chat import (
    CHOSEN_FIELD,
    PROMPT_FIELD,
    REJECTED_FIELD,
    ChatRenderer,
    Record,
    messages_of,
)
from cephalo.data.corpus import _listing
from cephalo.errors import CephaloError

CONVERSATIONAL, STANDARD = "conversational", "standard"
PAIR_FIELDS = (PROMPT_FIELD, CHOSEN_FIELD, REJECTED_FIELD)
FORMAT_HINT = (
    'a preference record is {"prompt": ..., "chosen": ..., "rejected": ...}: three strings '
    "(standard), or lists of messages (conversational: the prompt's turns, then the assistant's "
    "answers); without a prompt, chosen and rejected hold the whole exchange and share its start"
)


@dataclass(frozen=True)
class PairTokens:
    """One pair's tokens: the prompt's, and each completion's after it."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray
    retokenized: bool = False
    """The prompt's tokens were not a prefix of a row's: its completion was tokenized alone."""


@dataclass(frozen=True)
class _PairText:
    prompt: str
    chosen: str
    """The row's whole text: the prompt's text, then the chosen completion's."""
    rejected: str
    special_tokens: bool
    """Tokenize with the tokenizer's own special tokens (standard text, as TRL)."""


class PairRenderer:
    """Preference records -> `PairTokens`, with a fast transformers tokenizer (and its chat
    template, or `template`, for conversational records). The first record fixes the kind
    (conversational or standard) of the dataset; a record of the other kind is an error naming
    both."""

    def __init__(self, tokenizer: Any, template: str | None):
        self.chat = ChatRenderer(tokenizer, template, "prompt_completion", "completion")
        self.tok = tokenizer
        self.eos_text: str | None = getattr(tokenizer, "eos_token", None)
        self.kind: str | None = None
        self.first_where = ""

    # ---------------------------------------------------------------- one record
    def texts(self, record: Record) -> _PairText:
        value, where = record.value, record.where
        if not isinstance(value, dict):
            raise CephaloError(
                f"{where}: a JSON {type(value).__name__}, not an object; {FORMAT_HINT}"
            )
        for name in (CHOSEN_FIELD, REJECTED_FIELD):
            if name not in value or value[name] is None:
                raise CephaloError(
                    f"{where}: the record has no {name!r} (its fields: {_listing(value)}); "
                    f"{FORMAT_HINT}"
                )
        prompt = value.get(PROMPT_FIELD)
        kinds = {n: _kind_of(value[n], n, where) for n in PAIR_FIELDS if value.get(n) is not None}
        if len(set(kinds.values())) > 1:
            listed = ", ".join(f"{n} is {k}" for n, k in kinds.items())
            raise CephaloError(f"{where}: the record mixes formats ({listed}); {FORMAT_HINT}")
        kind = next(iter(kinds.values()))
        if self.kind is None:
            self.kind, self.first_where = kind, where
        elif kind != self.kind:
            raise CephaloError(
                f"{where}: a {kind} record, but {self.first_where} was {self.kind}; one dataset "
                f"holds one kind of preference records (mixed formats): prepare them separately"
            )
        for name in (CHOSEN_FIELD, REJECTED_FIELD):
            _check_not_empty(value[name], name, where)
        if kind == STANDARD:
            return self._standard(prompt, value[CHOSEN_FIELD], value[REJECTED_FIELD], where)
        return self._conversational(value, prompt is not None, where)

    def _standard(self, prompt: str | None, chosen: str, rejected: str, where: str) -> _PairText:
        if prompt is None:
            prompt, chosen, rejected = _shared_text_prefix(chosen, rejected, where)
            _check_not_empty(chosen, CHOSEN_FIELD, where)
            _check_not_empty(rejected, REJECTED_FIELD, where)
        eos = self.eos_text or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        return _PairText(prompt, prompt + chosen, prompt + rejected, special_tokens=True)

    def _conversational(self, value: dict, explicit: bool, where: str) -> _PairText:
        chosen = messages_of(value, CHOSEN_FIELD, where)
        rejected = messages_of(value, REJECTED_FIELD, where)
        if explicit:
            prompt = messages_of(value, PROMPT_FIELD, where)
        else:
            prompt, chosen, rejected = _shared_turns(chosen, rejected, where)
        before = self.chat.render(prompt, where, generation_prompt=True)
        rows = []
        for name, completion in ((CHOSEN_FIELD, chosen), (REJECTED_FIELD, rejected)):
            whole = self.chat.render(prompt + completion, where)
            if not whole.startswith(before):
                at = next(
                    (i for i, (a, b) in enumerate(zip(before, whole, strict=False)) if a != b),
                    min(len(before), len(whole)),
                )
                raise CephaloError(
                    f"{where}: the chat template renders the prompt (with its generation prompt) "
                    f"differently from the prompt followed by {name!r} (they part at character "
                    f"{at}: {before[at : at + 30]!r} vs {whole[at : at + 30]!r}), so the "
                    f"completion's tokens cannot be told apart; give a template whose render of "
                    f"a prompt is a prefix of the whole exchange with data.chat_template"
                )
            if len(whole) == len(before):
                raise CephaloError(
                    f"{where}: {name!r} renders to no text after the prompt: an empty completion "
                    f"has nothing to prefer; drop the pair"
                )
            rows.append(whole)
        return _PairText(before, rows[0], rows[1], special_tokens=False)

    # ---------------------------------------------------------------- batches of records
    def encode(self, records: Sequence[Record]) -> list[PairTokens]:
        """The tokens of each record's pair (one call of the fast tokenizer per kind of text)."""
        texts = [self.texts(r) for r in records]
        if not texts:
            return []
        special = texts[0].special_tokens  # one kind per dataset
        flat = [t for p in texts for t in (p.prompt, p.chosen, p.rejected)]
        ids = self.tok(
            flat, add_special_tokens=special, return_attention_mask=False, verbose=False
        )["input_ids"]
        out = []
        for i, (pair, record) in enumerate(zip(texts, records, strict=True)):
            prompt = np.asarray(ids[3 * i], dtype=np.int64)
            parts, retokenized = [], False
            for row, text in ((ids[3 * i + 1], pair.chosen), (ids[3 * i + 2], pair.rejected)):
                row = np.asarray(row, dtype=np.int64)
                if row.size > prompt.size and np.array_equal(row[: prompt.size], prompt):
                    parts.append(row[prompt.size :])
                    continue
                retokenized = True
                alone = self.tok(text[len(pair.prompt) :], add_special_tokens=False, verbose=False)[
                    "input_ids"
                ]
                if not alone:
                    raise CephaloError(
                        f"{record.where}: a completion tokenizes to no token: an empty "
                        f"completion has nothing to prefer; drop the pair"
                    )
                parts.append(np.asarray(alone, dtype=np.int64))
            out.append(PairTokens(prompt, parts[0], parts[1], retokenized))
        return out


def _kind_of(value: Any, name: str, where: str) -> str:
    if isinstance(value, str):
        return STANDARD
    if isinstance(value, list):
        return CONVERSATIONAL
    raise CephaloError(
        f"{where}: {name!r} holds a {type(value).__name__} ({json.dumps(value)[:60]}), not a string "
        f"or a list of messages; {FORMAT_HINT}"
    )


def _check_not_empty(value: str | list, name: str, where: str) -> None:
    if isinstance(value, str):
        empty = not value.strip()
    else:
        empty = not value or all(
            isinstance(m, dict)
            and not m.get("tool_calls")
            and isinstance(m.get("content"), str)
            and not m["content"].strip()
            for m in value
        )
    if empty:
        raise CephaloError(
            f"{where}: {name!r} is an empty completion ({json.dumps(value)[:60]}): a pair needs "
            f"two completions to prefer one of; drop the pair or fill it in"
        )


def _shared_turns(
    chosen: list[dict], rejected: list[dict], where: str
) -> tuple[list[dict], list[dict], list[dict]]:
    """The implicit prompt of two conversations: their longest shared run of turns (TRL's
    `extract_prompt`); what follows it must start with the assistant's answer in both."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == 0:
        raise CephaloError(
            f"{where}: 'chosen' and 'rejected' have different prompts (their first turns "
            f"differ) and the record has no 'prompt'; {FORMAT_HINT}"
        )
    for name, rest in ((CHOSEN_FIELD, chosen[n:]), (REJECTED_FIELD, rejected[n:])):
        if not rest:
            raise CephaloError(
                f"{where}: {name!r} is an empty completion: it holds nothing after the turns it "
                f"shares with the other; a pair needs two completions to prefer one of"
            )
        if rest[0]["role"] != "assistant":
            raise CephaloError(
                f"{where}: 'chosen' and 'rejected' have different prompts: they part at turn "
                f"{n + 1}, a {rest[0]['role']} turn in {name!r}, not the assistant's answer to "
                f"one shared prompt; {FORMAT_HINT}"
            )
    return chosen[:n], chosen[n:], rejected[n:]


def _shared_text_prefix(chosen: str, rejected: str, where: str) -> tuple[str, str, str]:
    """TRL's `extract_prompt` for strings: the shared characters, less a space before the
    point where they part (it starts the completions)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n and chosen[n - 1] == " ":
        n -= 1
    if n == 0:
        raise CephaloError(
            f"{where}: 'chosen' and 'rejected' share no start, so there is no prompt (and the "
            f"record has no 'prompt'); {FORMAT_HINT}"
        )
    return chosen[:n], chosen[n:], rejected[n:]
