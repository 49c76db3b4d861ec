"""The data: from a corpus of documents to the token windows a training step reads.

    request.py       what both commands ask alike: the default data directory, the validation fraction's range
    sources/         what a preparation reads, as documents in blocks: text files, JSON Lines records
    inputs.py        files, directories and globs expanded into the corpus's files (or the stdlib's)
    corpus.py        the corpus listed compactly, the default corpus's generated tables left out
    stream.py        text files as bounded blocks: where files are cut, which block is validation
    tokenizer.py     byte-level BPE with a fixed layout of 8449 ids; loading andrea's or a HF tokenizer.json
    bpe_training.py  training that BPE on a sample of the training text
    tokenfile.py     the token file: a header, then uint16 ids
    shards.py        encoding the blocks into token shards on every core, resumably
    manifest.py      meta.json, the data directory's manifest, and its splits opened as one sequence
    datadir.py       whose a data directory is, what it holds, what may be removed
    progress.py      the progress a preparation shows on stderr
    preparation.py   the whole preparation, phase by phase (`prepare`, `check_preparation`)
    lock.py          one process prepares a directory at a time
    loader.py        the batches training and evaluation read

`python -m andrea.prepare` (andrea/prepare.py) is the command around preparation.py.
"""
