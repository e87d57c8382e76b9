"""The tiny models' word-level tokenizer and chat template (`asyncrl.models.tiny`, `asyncrl.models.vision`)."""

from __future__ import annotations

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *ROLE_TOKENS)

# One turn is "<|role|> content <eos>"; the generation prompt is "<|assistant|>". Whitespace
# around tokens is irrelevant: the pre-tokenizer splits on it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|> ' + message['content'] + ' ' + eos_token + ' ' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(symbols: list[str] | None = None):
    """A word-level `PreTrainedTokenizerFast` over `symbols` (default: every synthetic symbol)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if symbols is None:
        from asyncrl.data.synthetic import all_symbols

        symbols = all_symbols()
    words = [*SPECIAL_TOKENS, *(s for s in symbols if s not in SPECIAL_TOKENS)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        model_max_length=256,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
