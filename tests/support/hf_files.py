"""Hugging Face files made here, offline, for the tests of the import and of the documented commands."""

import json


def foreign_tokenizer(directory, texts, vocab_size=400, transformers=None):
    """A HF byte-level BPE not laid out as andrea's: <|endoftext|> at id 0, or, saved by transformers'
    GPT2Tokenizer when `transformers` is given, at the end as in GPT-2. Returns its vocabulary size."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    special = [] if transformers else ["<|endoftext|>"]
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                     show_progress=False))
    if transformers is None:
        t.save(str(directory / "tokenizer.json"))
        return t.get_vocab_size()
    model = json.loads(t.to_str())["model"]
    vocab = {**model["vocab"], "<|endoftext|>": len(model["vocab"])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    transformers.GPT2Tokenizer(vocab=vocab, merges=merges).save_pretrained(directory)
    return len(vocab)
