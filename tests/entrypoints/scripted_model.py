"""A tiny Qwen3 checkpoint whose greedy output is written in advance: a reasoning model to test with.

Its one decoder layer contributes nothing (the attention and MLP output
projections are zero), so the hidden state of a token is its embedding and
the next token depends on the current one only: a bigram model. Embeddings
of the scripted tokens are orthonormal and the LM head maps each scripted
token to its successor with a large logit, so greedy decoding follows
``CHAIN``; every other logit is small noise, so where a grammar forbids the
scripted token, the choice among the allowed ones is arbitrary but fixed.

The chat template is Qwen3's in miniature: the generation prompt ends with
``<|assistant|>`` (the model then opens with ``<think>``), or, with
``enable_thinking: false``, with a closed ``<think>\\n\\n</think>\\n\\n``.
The tokenizer is byte-level, with the tags and the scripted pieces as added
tokens (so ``<think>`` is one token, as in Qwen3).
"""

from __future__ import annotations

import json
from pathlib import Path

THINKING = "Checking the weather."
ANSWER = "Let me look."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
# What the model writes after the generation prompt, token by token.
CHAIN = [
    "<|assistant|>",
    "<think>",
    THINKING,
    "</think>",
    "\n\n",
    ANSWER,
    "<tool_call>",
    json.dumps(CALL),
    "</tool_call>",
    "<|im_end|>",
]
TEXT = "".join(CHAIN[1:-1])

TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_SPECIAL = ["<|im_start|>", "<|im_end|>", "<|assistant|>"]
_HIDDEN = 64


def write_scripted_model(path: Path) -> Path:
    """Write the checkpoint (config, safetensors, tokenizer) into ``path``."""
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    pieces = [t for t in CHAIN if t not in _SPECIAL]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in pieces])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = TEMPLATE
    ids = [tokenizer.convert_tokens_to_ids(t) for t in CHAIN]
    for token, token_id in zip(CHAIN, ids, strict=True):
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id], token

    vocab = len(tokenizer)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=_HIDDEN,
        intermediate_size=2 * _HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=_HIDDEN // 2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=ids[-1],
        bos_token_id=None,
        torch_dtype="float32",
    )
    generator = torch.Generator().manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        embed = torch.randn(vocab, _HIDDEN, generator=generator)
        embed /= embed.norm(dim=1, keepdim=True)
        # The scripted tokens get orthonormal embeddings: no successor row
        # competes with another's.
        basis, _ = torch.linalg.qr(torch.randn(_HIDDEN, len(ids), generator=generator))
        embed[ids] = basis.T
        head = 0.02 * torch.randn(vocab, _HIDDEN, generator=generator)
        for current, successor in zip(ids, ids[1:], strict=False):
            head[successor] = 4.0 * embed[current]
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
