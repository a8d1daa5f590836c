"""Train the demo byte-level BPE tokenizer (run once, offline; the result is committed).

The corpus is text that ships with every Python install and with this project's
own dependencies: docstrings of the standard library and the long descriptions
in installed packages' METADATA. That gives English prose plus code, which is
what a demo model for a JSON-shaped-output server sees.

    python -m engine.presets.train_tokenizer engine/presets/tokenizer
"""

from __future__ import annotations

import ast
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# ChatML rendering; a generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _stdlib_docstrings() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def _package_descriptions() -> Iterator[str]:
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info/METADATA")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        _, _, body = text.partition("\n\n")
        if body:
            yield body


def _json_samples() -> Iterator[str]:
    # A little JSON so that braces, quotes and keys get sensible merges.
    for i in range(2000):
        yield json.dumps({"id": i, "name": f"item {i}", "tags": ["a", "b"], "ok": i % 2 == 0})
        yield json.dumps({"id": i, "name": f"item {i}"}, indent=2)


def corpus() -> Iterator[str]:
    yield from _stdlib_docstrings()
    yield from _package_descriptions()
    yield from _json_samples()


def train(out_dir: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    save_tokenizer(tok, out_dir, {"model_max_length": 2048, "chat_template": CHAT_TEMPLATE})


def save_tokenizer(tok: Tokenizer, out_dir: Path, extra: dict | None = None) -> None:
    """Write tokenizer.json and a tokenizer_config.json with our special tokens."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        **(extra or {}),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    train(Path(sys.argv[1] if len(sys.argv) > 1 else "engine/presets/tokenizer"))
