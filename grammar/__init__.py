"""stencild structured output: grammar specs, compilers and matchers.

One interface over xgrammar and llguidance:

    from grammar import GrammarCompiler, GrammarSpec, apply_token_bitmask_inplace

    compiler = GrammarCompiler(tokenizer, vocab_size=model_vocab, eos_token_ids=stop_ids)
    matcher = compiler.compile_async(GrammarSpec.json_schema(schema)).result()
    bitmask = compiler.allocate_bitmask(batch_size)
    compiler.fill_bitmasks([matcher], bitmask)
    apply_token_bitmask_inplace(logits, bitmask)
    matcher.accept_token(sampled)

The package knows nothing of models or gRPC; docs/structured-output.md
describes what it offers a client.
"""

from .bitmask import BitmaskFiller, allocate_bitmask, apply_token_bitmask_inplace
from .cache import CacheInfo, GrammarCache
from .compiler import BACKENDS, JSON_ORDER, GrammarCompiler
from .config import CompilerConfig
from .errors import GrammarError
from .export import CompiledExport
from .matcher import Matcher
from .schema_store import SchemaStore
from .spec import KINDS, GrammarOptions, GrammarSpec
from .tokenizer import TokenizerData

__all__ = [
    "BACKENDS",
    "JSON_ORDER",
    "KINDS",
    "BitmaskFiller",
    "CacheInfo",
    "CompiledExport",
    "CompilerConfig",
    "GrammarCache",
    "GrammarCompiler",
    "GrammarError",
    "GrammarOptions",
    "GrammarSpec",
    "Matcher",
    "SchemaStore",
    "TokenizerData",
    "allocate_bitmask",
    "apply_token_bitmask_inplace",
]
