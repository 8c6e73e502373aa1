"""Chat data: conversations and prompt-completion records, rendered with the tokenizer's own
chat template, each token marked as a loss token or not.

Formats (`data.format`, detected per file by `detect_format` when `auto`):

    text                the corpus pipeline of `corpus.py` / `data.py` (every token in the loss)
    chat                {"messages": [{"role": "system" | "user" | "assistant" | "tool",
                                       "content": str | [{"type": "text", "text": str}, ...]}]}
    prompt_completion   TRL's {"prompt": ..., "completion": ...}: two strings, or two lists of
                        messages (the prompt's, then the completion's)
    preference          TRL's {"prompt": ..., "chosen": ..., "rejected": ...} (or `chosen` and
                        `rejected` alone, the prompt implicit): pairs of completions, prepared by
                        `cephalo.preference.data` (DPO), not by this module's renderer

Which tokens are in the loss (`data.loss_on`):

    assistant   the assistant's turns (the default for conversations). Turn k's characters are
                render(messages[:k+1]) minus render(messages[:k], add_generation_prompt=True),
                so they include the end-of-turn text the template puts after the content.
                Where the template has `{% generation %}` markers this is transformers'
                `return_assistant_tokens_mask`, and it needs no markers.
    completion  the completion (the default for prompt-completion): what follows the rendered
                prompt (with the generation prompt), or the completion string and an EOS
    all         every token

A token is a loss token when its first character (the fast tokenizer's offsets) lies in one
of those spans. A template whose partial renders are not prefixes of the whole (one that
drops earlier turns' reasoning, say) cannot say which tokens are whose: it is refused with
a message naming the turn.

Records are read by `read_records` as a stream (JSON Lines line by line, Parquet by row
group, `datasets` directories in row batches), so a bad record is named by file and line
(or row); `prepare_chat_dataset` (`chat_data.py`) writes the ids and masks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cephalo.data.corpus import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    SUPPORTED_SUFFIXES,
    _dataset_split_dir,
    _datasets,
    _listing,
    _pyarrow,
    is_datasets_dir,
    rows_per_batch,
)
from cephalo.errors import CephaloError, first_line

FORMATS = ("auto", "text", "chat", "prompt_completion", "preference")
LOSS_ON = ("auto", "assistant", "completion", "all")
ROLES = ("system", "user", "assistant", "tool")
MESSAGES_FIELD = "messages"
PROMPT_FIELD, COMPLETION_FIELD = "prompt", "completion"
CHOSEN_FIELD, REJECTED_FIELD = "chosen", "rejected"
TEMPLATE_HINT = (
    "give one with data.chat_template (--chat-template): a Jinja file, or the template string "
    "itself (e.g. the chat_template of a model of the same family)"
)
RENDER_BATCH = 256
"""Records rendered and tokenized at a time (one call of the fast tokenizer)."""


@dataclass(frozen=True)
class Record:
    """One record of a source, as read."""

    where: str
    """`FILE, line N` or `FILE, row N`: for messages."""
    value: Any
    """The parsed record (a dict, or what the line held)."""
    source_bytes: int
    """Bytes of the source it accounts for (the progress bar)."""


# ----------------------------------------------------------------------------- reading
def chat_sources(inputs: Sequence[str | Path]) -> list[Path]:
    """The files and datasets directories of `inputs`, in the order the corpus reads them."""
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and is_datasets_dir(path):
            found.append(path)
        elif path.is_dir():
            found.extend(
                sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
            )
        elif path.is_file():
            found.append(path)
        else:
            raise CephaloError(f"input {path} does not exist")
    return found


def read_records(path: Path) -> Iterator[Record]:
    """Every record of a JSON Lines file, Parquet file or `datasets` directory, in order."""
    if path.is_dir():
        yield from _dataset_records(path)
    elif path.suffix in PARQUET_SUFFIXES:
        yield from _parquet_records(path)
    elif path.suffix in JSONL_SUFFIXES:
        yield from _jsonl_records(path)
    else:
        raise CephaloError(
            f"{path}: chat data is read from JSON Lines, Parquet or a datasets directory, not "
            f"from a {path.suffix or 'plain'} file; set data.format = text (--format text) "
            f"to train on it as text"
        )


def _jsonl_records(path: Path) -> Iterator[Record]:
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                where = f"{path}, line {lineno}"
                if not line.strip():
                    continue  # a blank line is no record
                try:
                    value = json.loads(line)
                except ValueError as e:
                    raise CephaloError(
                        f"{where}: not valid JSON ({e}); each line of a JSON Lines file must "
                        f"be one JSON object"
                    ) from e
                yield Record(where, value, len(line))
    except OSError as e:
        raise CephaloError(f"cannot read {path} ({e})") from e


def _parquet_records(path: Path) -> Iterator[Record]:
    pa, pq = _pyarrow(f"reading the Parquet file {path}")
    try:
        file = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
        rows, size = file.metadata.num_rows, path.stat().st_size
        per_batch = rows_per_batch(rows, size)
        row = 0
        # one row group at a time, as corpus.ParquetSource (bounded memory)
        for group in range(file.metadata.num_row_groups):
            table = file.read_row_group(group, use_threads=False)
            for batch in table.to_batches(max_chunksize=per_batch):
                for value in batch.to_pylist():
                    row += 1
                    yield Record(f"{path}, row {row}", value, size // max(rows, 1))
            del table
    except (OSError, pa.ArrowException) as e:
        raise CephaloError(f"cannot read the Parquet file {path} ({e})") from e


def _dataset_records(path: Path) -> Iterator[Record]:
    datasets = _datasets(f"reading the datasets directory {path}")
    split_dir, _ = _dataset_split_dir(path)
    try:
        dataset = datasets.load_from_disk(str(split_dir))
    except Exception as e:  # the library raises many kinds on damaged directories
        raise CephaloError(f"cannot load the datasets directory {split_dir} ({e})") from e
    size = sum(Path(f["filename"]).stat().st_size for f in dataset.cache_files)
    per_batch = rows_per_batch(dataset.num_rows, size)
    row = 0
    for batch in dataset.iter(batch_size=per_batch):
        names = list(batch)
        for i in range(len(batch[names[0]]) if names else 0):
            row += 1
            value = {n: batch[n][i] for n in names}
            yield Record(f"{path}, row {row}", value, size // max(dataset.num_rows, 1))


def detect_format(path: Path) -> str:
    """`chat`, `prompt_completion`, `preference` or `text`, from a source's first record (or
    columns)."""
    if (path.is_dir() and is_datasets_dir(path)) or path.suffix in PARQUET_SUFFIXES:
        fields = _columns(path)
    elif path.suffix in JSONL_SUFFIXES:
        first = next(_jsonl_records(path), None)
        fields = list(first.value) if first is not None and isinstance(first.value, dict) else []
    else:
        return "text"
    return format_of_fields(fields)


def format_of_fields(fields: Sequence[str]) -> str:
    """The format records with these fields hold: `chosen` and `rejected` make a preference
    pair (TRL's explicit- or implicit-prompt form) whatever else is there."""
    if CHOSEN_FIELD in fields and REJECTED_FIELD in fields:
        return "preference"
    if MESSAGES_FIELD in fields:
        return "chat"
    if PROMPT_FIELD in fields and COMPLETION_FIELD in fields:
        return "prompt_completion"
    return "text"


def _columns(path: Path) -> list[str]:
    if path.is_dir():
        datasets = _datasets(f"reading the datasets directory {path}")
        split_dir, _ = _dataset_split_dir(path)
        try:
            return list(datasets.load_from_disk(str(split_dir)).features)
        except Exception as e:  # noqa: BLE001 (the library raises many kinds)
            raise CephaloError(f"cannot load the datasets directory {split_dir} ({e})") from e
    pa, pq = _pyarrow(f"reading the Parquet file {path}")
    try:
        return list(pq.ParquetFile(path).schema_arrow.names)
    except (OSError, pa.ArrowException) as e:
        raise CephaloError(f"cannot read the Parquet file {path} ({e})") from e


def detect_inputs_format(inputs: Sequence[str | Path], forced: str = "auto") -> str:
    """The one format of a dataset's inputs: `forced` unless `auto`, else detected per file;
    files of different formats in one dataset are an error naming two of them."""
    if forced not in FORMATS:
        raise CephaloError(f"data.format must be one of {', '.join(FORMATS)}, got {forced!r}")
    if forced != "auto":
        return forced
    seen: dict[str, Path] = {}
    for path in chat_sources(inputs):
        seen.setdefault(detect_format(path), path)
    if len(seen) > 1:
        (a, pa_), (b, pb) = list(seen.items())[:2]
        raise CephaloError(
            f"the inputs mix formats: {pa_} holds {a} and {pb} holds {b}; one dataset holds one "
            f"format: prepare them separately, or set data.format (--format)"
        )
    return next(iter(seen), "text")


# ----------------------------------------------------------------------------- rendering
def default_loss_on(fmt: str) -> str:
    return {"chat": "assistant", "prompt_completion": "completion"}.get(fmt, "all")


def load_chat_template(value: str | None) -> str | None:
    """`data.chat_template`: None, a Jinja file's path, or the template string itself."""
    if not value:
        return None
    if "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    if "{" not in value:
        raise CephaloError(
            f"data.chat_template {value!r} is neither a file nor a Jinja template string; "
            f"{TEMPLATE_HINT}"
        )
    return value


class ChatRenderer:
    """Records -> (token ids, loss mask), with a transformers tokenizer's chat template.

    tokenizer: a fast transformers tokenizer (offsets are needed). template: the Jinja
    template (None: the tokenizer's own). fmt: `chat` or `prompt_completion`. loss_on:
    `assistant`, `completion` or `all` (`auto`: by format)."""

    def __init__(self, tokenizer: Any, template: str | None, fmt: str, loss_on: str = "auto"):
        if fmt not in ("chat", "prompt_completion"):
            raise CephaloError(
                f"ChatRenderer renders chat or prompt_completion, not {fmt!r} (preference pairs: "
                f"cephalo.preference.data)"
            )
        if loss_on not in LOSS_ON:
            raise CephaloError(f"data.loss_on must be one of {', '.join(LOSS_ON)}, got {loss_on!r}")
        self.tok, self.fmt = tokenizer, fmt
        self.loss_on = default_loss_on(fmt) if loss_on == "auto" else loss_on
        if fmt == "chat" and self.loss_on == "completion":
            raise CephaloError(
                "data.loss_on = completion is for prompt-completion records; conversations "
                "train on the assistant's turns (assistant) or on every token (all)"
            )
        if not getattr(tokenizer, "is_fast", False):
            raise CephaloError(
                f"chat data needs a fast tokenizer (tokenizer.json), which gives each token's "
                f"characters; {type(tokenizer).__name__} is not one"
            )
        self.template = template if template is not None else tokenizer.chat_template
        self.eos_id = tokenizer.eos_token_id
        self._template_checked = False

    def require_template(self) -> None:
        if self.template is None:
            raise CephaloError(
                f"the tokenizer {getattr(self.tok, 'name_or_path', '')} has no chat template, "
                f"so conversations cannot be rendered; {TEMPLATE_HINT}"
            )

    def render(self, messages: list[dict], where: str, generation_prompt: bool = False) -> str:
        self.require_template()
        try:
            text = self.tok.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self.template,
            )
        except Exception as e:  # jinja2 errors, the template's raise_exception, KeyError ...
            raise CephaloError(
                f"{where}: the chat template raised {type(e).__name__}: {first_line(e)}"
            ) from e
        if not isinstance(text, str):
            raise CephaloError(f"{where}: the chat template did not render a string")
        return text

    # ---------------------------------------------------------------- one record
    def text_and_spans(self, record: Record) -> tuple[str, list[tuple[int, int]], int | None]:
        """The rendered text, the character spans of its loss tokens, and an id to append
        (the EOS after a completion string) or None."""
        value = record.value
        if not isinstance(value, dict):
            raise CephaloError(
                f"{record.where}: a JSON {type(value).__name__}, not an object; each record "
                f"must be one object"
            )
        if self.fmt == "chat":
            messages = messages_of(value, MESSAGES_FIELD, record.where)
            return self._conversation(messages, 0, record.where)
        for name in (PROMPT_FIELD, COMPLETION_FIELD):
            if name not in value:
                raise CephaloError(
                    f"{record.where}: the record has no {name!r} field (its fields: "
                    f"{_listing(value)}); prompt-completion records hold 'prompt' and "
                    f"'completion'"
                )
        prompt, completion = value[PROMPT_FIELD], value[COMPLETION_FIELD]
        if isinstance(prompt, str) and isinstance(completion, str):
            if self.loss_on == "assistant":
                raise CephaloError(
                    f"{record.where}: data.loss_on = assistant needs conversations, but this "
                    f"prompt and completion are strings; use completion or all"
                )
            text = prompt + completion
            start = 0 if self.loss_on == "all" else len(prompt)
            return text, [(start, len(text))], self.eos_id
        prompt_msgs = messages_of(value, PROMPT_FIELD, record.where)
        completion_msgs = messages_of(value, COMPLETION_FIELD, record.where)
        return self._conversation(prompt_msgs + completion_msgs, len(prompt_msgs), record.where)

    def _conversation(
        self, messages: list[dict], prompt_len: int, where: str
    ) -> tuple[str, list[tuple[int, int]], int | None]:
        full = self.render(messages, where)
        if self.loss_on == "all":
            return full, [(0, len(full))], None
        if self.loss_on == "completion":
            before = self.render(messages[:prompt_len], where, generation_prompt=True)
            _check_prefix(before, full, where, "the prompt with its generation prompt")
            return full, [(len(before), len(full))], None
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], where, generation_prompt=True)
            upto = full if k + 1 == len(messages) else self.render(messages[: k + 1], where)
            turn = f"turn {k + 1} (assistant)"
            _check_prefix(before, upto, where, f"the conversation before {turn}", turn)
            _check_prefix(upto, full, where, f"the conversation up to {turn}")
            spans.append((len(before), len(upto)))
        if not spans:
            raise CephaloError(
                f"{where}: the conversation has no assistant turn, so no token would be trained "
                f"on (roles: {', '.join(m['role'] for m in messages)}); drop it, or set "
                f"data.loss_on = all"
            )
        return full, spans, None

    # ---------------------------------------------------------------- batches of records
    def encode(self, records: Sequence[Record]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, loss mask) of each record: ids int64, mask bool (True: a loss token)."""
        rendered = [self.text_and_spans(r) for r in records]
        if not rendered:
            return []
        enc = self.tok(
            [text for text, _, _ in rendered],
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            verbose=False,
        )
        out = []
        for (_, spans, extra), ids, offsets in zip(
            rendered, enc["input_ids"], enc["offset_mapping"], strict=True
        ):
            starts = np.asarray([o[0] for o in offsets], dtype=np.int64)
            mask = np.zeros(len(ids), dtype=bool)
            for a, b in spans:
                mask |= (starts >= a) & (starts < b)
            ids = np.asarray(ids, dtype=np.int64)
            if extra is not None:
                ids, mask = np.append(ids, extra), np.append(mask, True)
            out.append((ids, mask))
        return out


def messages_of(record: dict, field: str, where: str) -> list[dict]:
    """The record's list of messages under `field`, checked: roles known, contents strings
    (a list of text parts is joined), at least one message."""
    if field not in record:
        raise CephaloError(
            f"{where}: the record has no {field!r} field (its fields: {_listing(record)}); a "
            f'conversation is {{"messages": [{{"role": ..., "content": ...}}, ...]}}'
        )
    messages = record[field]
    if not isinstance(messages, list):
        raise CephaloError(
            f"{where}: {field!r} holds a {type(messages).__name__}, not a list of messages"
        )
    if not messages:
        raise CephaloError(f"{where}: {field!r} is an empty conversation (no messages)")
    checked = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m:
            raise CephaloError(
                f"{where}: message {i} of {field!r} is not an object with a 'role' "
                f"(got {json.dumps(m)[:80]})"
            )
        role = m["role"]
        if role not in ROLES:
            raise CephaloError(
                f"{where}: message {i} has the unknown role {role!r}; roles are {', '.join(ROLES)}"
            )
        content = m.get("content")
        if isinstance(content, list):
            content = _join_text_parts(content, where, i)
        elif content is None and m.get("tool_calls"):
            content = ""
        elif not isinstance(content, str):
            raise CephaloError(
                f"{where}: message {i} ({role}) has content of type "
                f"{type(content).__name__}; content must be a string or a list of text parts "
                f'({{"type": "text", "text": ...}})'
            )
        checked.append({**{k: v for k, v in m.items() if v is not None}, "content": content})
    return checked


def _join_text_parts(parts: list, where: str, i: int) -> str:
    texts = []
    for part in parts:
        if isinstance(part, dict) and part.get("type", "text") == "text":
            text = part.get("text")
            if isinstance(text, str):
                texts.append(text)
                continue
        raise CephaloError(
            f"{where}: message {i} has a content part that is not text ({json.dumps(part)[:80]}); "
            f"content must be a string or a list of text parts"
        )
    return "".join(texts)


def _check_prefix(prefix: str, whole: str, where: str, what: str, turn: str = "") -> None:
    if whole.startswith(prefix):
        return
    at = next((i for i, (a, b) in enumerate(zip(prefix, whole, strict=False)) if a != b), None)
    at = min(len(prefix), len(whole)) if at is None else at
    raise CephaloError(
        f"{where}: the chat template renders {what} differently from the whole conversation "
        f"(they part at character {at}: {prefix[at : at + 30]!r} vs {whole[at : at + 30]!r}), "
        f"so the assistant's tokens cannot be told apart; give a template whose renders of a "
        f"conversation's beginning are prefixes of the whole with data.chat_template"
        + (f" ({turn})" if turn else "")
    )
