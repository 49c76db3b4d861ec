"""The data: from a corpus of text files to the token windows a training step reads.

    tokenizer.py     byte-level BPE with a fixed layout of 8449 ids; tiktoken encodes, tokenizers trains
    stream.py        the corpus as bounded blocks: where files are cut, which block is validation
    shards.py        encoding those blocks into token shards on every core, resumably
    dataset.py       corpus files, token files and their manifest, the batches training samples

`python -m andrea.prepare` (andrea/prepare.py) runs these in order.
"""
