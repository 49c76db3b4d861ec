"""A prepared split read back as documents: its token ids cut at each end-of-text id."""

import numpy as np


def split_documents(tok, tokens):
    """The texts between end-of-text ids; every document ends with one (asserted)."""
    ids = np.asarray(tokens).tolist()
    docs, current = [], []
    for i in ids:
        if i == tok.eot_id:
            docs.append(tok.decode(current))
            current = []
        else:
            current.append(i)
    assert current == []  # every document ends with EOT
    return docs
