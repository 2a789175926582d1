"""Loading the tokenizer that belongs to a checkpoint, offline.

``load_tokenizer(path) -> PreTrainedTokenizerBase`` takes a HF model directory
(its tokenizer files) or a ``.gguf`` file, whose tokenizer transformers rebuilds
from the GGUF metadata. For GGUF the chat template and EOS token are set from
``tokenizer.chat_template`` / ``tokenizer.ggml.eos_token_id`` explicitly, so a
transformers version that skips them cannot leave the engine without them.
The Hub is never contacted.
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tokenloom.model.gguf_loader import open_gguf


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = Path(path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a model directory or a .gguf file"
        )
    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    reader = open_gguf(path)
    template = reader.fields.get("tokenizer.chat_template")
    if template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = template.contents()
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        eos_id = int(eos.contents())
        if tokenizer.eos_token_id != eos_id:
            tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    return tokenizer
