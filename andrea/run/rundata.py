"""The run's data: its data directory prepared if missing, its splits opened, and what tells one
rank's data from another's.

Training needs nothing of the corpus once its data directory is prepared (andrea.data.preparation):
`prepare_data` prepares it when it is missing or answers another request (on rank 0, while the other
ranks wait) and opens the tokenizer and both splits as the manifest names them.
"""

import hashlib
import json
import math
import sys

import numpy as np

from andrea.data import lock
from andrea.data.manifest import open_split, read_data_meta
from andrea.data.preparation import prepare
from andrea.data.tokenizer import load_tokenizer
from andrea.errors import UserError
from andrea.run import preflight


def print_note(msg):
    print(msg, file=sys.stderr, flush=True)


def prepare_data(cfg, build=True, tokenizer=None, note=print_note):
    """Tokens and tokenizer for the config's corpus, preparing them first if they are missing (build).

    `tokenizer` (a path) is the one to encode with instead of training one (--init-from's); `note`
    says what happens (rank 0's, under mpiexec).
    """
    data_dir = cfg.data.resolved_dir()
    if preflight.prepared_counts(data_dir) is None:
        note(f"first run on this corpus: preparing {data_dir} (tokenizer and token files; later runs reuse it)")
    # prepare() returns at once when data_dir already holds this corpus, and refuses another one
    if build:
        try:
            prepare(**preflight.data_request(cfg, tokenizer), progress=True)
        except UserError as e:
            raise UserError(preflight.in_train_terms(str(e))) from e
    with lock.reading(data_dir, note):  # one preparation's files, should another process prepare it now
        tokenizer = load_tokenizer(data_dir / "tokenizer.json")
        preflight.fit_vocabulary(cfg, tokenizer, data_dir, note)
        fp = tokenizer.fingerprint()
        # the token files hold the tokenizer's ids, which a padded model.vocab_size holds too
        train_tokens = open_split(data_dir, "train", tokenizer.vocab_size, fp)
        val_tokens = open_split(data_dir, "val", tokenizer.vocab_size, fp)
    return tokenizer, train_tokens, val_tokens


def data_fingerprint(data_dir, train_tokens, val_tokens, ids=4096):
    """sha256 of what a rank trains on, cheaply: the manifest's shard table (names, token counts,
    largest ids, the tokenizer's fingerprint) and the first and last `ids` ids of every shard."""
    meta = read_data_meta(data_dir) or {}
    table = {k: meta.get(k) for k in ("shards", "train_tokens", "val_tokens", "tokenizer_fingerprint")}
    digest = hashlib.sha256(json.dumps(table, sort_keys=True).encode())
    for split in (train_tokens, val_tokens):
        for shard in split.shards:
            digest.update(np.ascontiguousarray(shard[:ids]).tobytes() + np.ascontiguousarray(shard[-ids:]).tobytes())
    return digest.hexdigest()


def unigram_baseline(cfg):
    """The validation tokens' unigram entropy in nats (the loss of predicting every token by its
    frequency in the training tokens) from the data directory's meta.json; None when it has none."""
    value = (read_data_meta(cfg.data.resolved_dir()) or {}).get("unigram_val_nats")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
