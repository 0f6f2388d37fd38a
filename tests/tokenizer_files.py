"""Small, real Hugging Face tokenizer directories built at test time (nothing binary committed).

`write_tokenizer(directory, style)` trains a byte-level BPE (as GPT-2, Llama 3 and Qwen use) on a
few sentences with the `tokenizers` package and writes ``tokenizer.json`` and
``tokenizer_config.json`` with a chat template of that style: ``chatml`` (Qwen's
``<|im_start|>role ... <|im_end|>``, tools as JSON in a system block) or ``llama3`` (the template
writes ``bos_token``; the config sets ``add_bos_token``, so a prompt encoded with special tokens
starts with it too). The same directory is what a simulated engine (`tokenizer` parameter) and
the gateway load.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "You are a careful assistant who answers briefly.",
    "What is a prefix cache, and why does it help?",
    "It keeps the KV blocks of prompts it computed, so a later prompt skips them.",
    "The gateway routes each request to the engine that holds most of its prompt.",
    "Tokens, blocks and batches: the engine schedules them all.",
    "Hello! How can I help you today? Tell me a story about a river and a stone.",
]

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- if tools %}\n"
    "{{- '<|im_start|>system\\n# Tools\\n' }}\n"
    "{%- for tool in tools %}\n"
    "{{- tool | tojson }}\n"
    "{{- '\\n' }}\n"
    "{%- endfor %}\n"
    "{{- '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] != 'system' %}\n"
    "{{- raise_exception('the first message must be the system prompt') }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "{{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def write_tokenizer(directory: Path, style: str = "chatml") -> Path:
    """A tokenizer directory of `style` (``chatml`` or ``llama3``) in `directory`."""
    specials = CHATML_SPECIALS if style == "chatml" else LLAMA3_SPECIALS
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if style == "chatml":
        config = {
            "chat_template": CHATML_TEMPLATE,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
        }
    else:
        config = {
            "chat_template": LLAMA3_TEMPLATE,
            "bos_token": {"content": "<|begin_of_text|>", "special": True},
            "eos_token": "<|eot_id|>",
            "add_bos_token": True,
        }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory
