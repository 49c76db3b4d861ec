"""The records of an offline W&B run directory, read back as W&B wrote them, for the tests of the W&B sink.

    history(run_dir)   # [{"_step": 1, "train/loss": 9.1, ...}, ...] of every run-*.wandb file under it

wandb 0.31 keeps the reader of its run files inside wandb-core (Go); the Python package keeps the
record schema (wandb.proto.wandb_internal_pb2.Record). The file itself is LevelDB's log format
behind a 7-byte header (":W&B", the magic 0xBEE1, version 0): blocks of 32 KiB holding records,
each a 7-byte header (CRC-32 of its type byte then its data, the data's length, its type: 1 whole,
2 first, 3 middle, 4 last piece) and its data; a block's last bytes, too few for a header, are
zeros. Every checksum is verified, so a misread file fails rather than passing by luck.
"""

import json
import struct
import zlib
from pathlib import Path

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    """The protobuf Records of one run-*.wandb file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:7] == HEADER, f"{path} is not a W&B run file"
    pos, pieces = 7, []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # the block's padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        body = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at byte {pos}"
        pos += 7 + length
        pieces.append(body)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def history(run_dir):
    """Every history row (a run.log call) of the run files under run_dir, in file then row order."""
    rows = []
    for path in sorted(Path(run_dir).rglob("run-*.wandb")):
        for record in records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
