"""Data: sources read as a bounded stream (`corpus`), plain text as token files (`text`), chat
data (`chat`, `chat_data`, `packing`), tokenizers (`tokenizer`, `hf_tokenizer`) and the
self-made chat example (`chat_example`).

Import from the submodules; this package imports nothing itself so that `cephalo --help`
stays fast."""
