"""Tokenizers that reproduce llama.cpp's tokenization exactly, with the bookkeeping a live view needs.

The merging runs in Hugging Face `tokenizers` (Rust, fast enough to re-tokenize on every keystroke). This package
builds that tokenizer from a GGUF vocabulary or a Hugging Face model directory, then adds what the UI shows:
per-token byte and character spans, readable pieces, special-token flags, and the input bytes the vocabulary cannot
represent (byte-level BPE drops those; we report them instead).

Two GGUF vocabulary kinds (`tokenizer.ggml.model`), each as llama.cpp's llama-vocab.cpp treats it:
- `gpt2`, byte-level BPE (SmolLM2, Llama 3, Qwen2, GPT-2, Falcon, DeepSeek, StarCoder, ...): llama.cpp first splits
  the text with the regexes of its pre-tokenizer (`tokenizer.ggml.pre`), then merges by rank. Every pre-tokenizer
  name llama.cpp knows is either reproduced here (`SUPPORTED_PRE`) or refused with an error naming it.
- `llama`, SentencePiece-style (Llama 2, Mistral, Phi-3, Gemma): spaces become U+2581, a space is put in front of
  each piece of text that starts the prompt or follows a special token (if `add_space_prefix`), and symbols are
  merged greedily by the *score* of the token they would form (ties: leftmost first). Characters left without a token
  become byte-fallback tokens `<0xNN>`. That score-driven merge is expressed as a BPE merge list: every way a token
  splits into two tokens is a merge, ranked by the token's score (spm.py).
Special tokens are found in the text the way llama.cpp's tokenizer_st_partition finds them (longest first, with its
lstrip/rstrip rules); the merging then runs on the text between them.

Modules: core (the Tokenizer: encode/align/decode), build (its constructors), cache (its disk cache), chat (chat
templates in a sandbox, within a time and size budget), pretokenize (llama.cpp's pre-tokenizer regexes), spm
(SentencePiece merges), vocab (GGUF token types, special-token rules, GPT-2's byte table).
"""

from engine.tokenizer.cache import CACHE_FORMAT
from engine.tokenizer.chat import CHATML_TEMPLATE, ChatTemplateRefused
from engine.tokenizer.core import StreamDecoder, Tokenization, Tokenizer, char_spans
from engine.tokenizer.pretokenize import SUPPORTED_PRE, llama_cpp_pre_type
from engine.tokenizer.vocab import bytes_to_unicode

__all__ = [
    "CACHE_FORMAT",
    "CHATML_TEMPLATE",
    "ChatTemplateRefused",
    "SUPPORTED_PRE",
    "StreamDecoder",
    "Tokenization",
    "Tokenizer",
    "bytes_to_unicode",
    "char_spans",
    "llama_cpp_pre_type",
]
