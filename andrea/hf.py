"""The Hugging Face format, both ways: a GPT-2 directory that transformers loads, and one andrea loads.

    model.save_pretrained("export/", tokenizer=tok)   # config.json, model.safetensors, tokenizer files
    model = ANDREA.from_pretrained("export/")         # or a GPT-2 saved by transformers (safetensors)
    tok = load_tokenizer("export/")                   # andrea's tokenizer.json or a HF one

andrea's parameters already carry GPT2LMHeadModel's state-dict names in its Conv1D (in, out) layout
(SPEC 1), so the weights are copied name for name. What this module adds:

- the configuration: n_positions <-> context_length, n_embd <-> d_model, n_inner <-> mlp_dim,
  layer_norm_epsilon <-> ln_eps; what GPT-2's configuration can say and andrea cannot compute
  (another activation, an untied head, the scaled-attention variants) is refused by name;
- the weights file: safetensors only (a pickled pytorch_model.bin is refused with the command that
  converts it), read by a small reader of its own so bfloat16 and float16 files load too;
- the tokenizer in HF's tokenizer.json form: andrea's byte-level BPE becomes a HF BPE model with
  the ByteLevel pre-tokenizer and decoder (GPT-2's own arrangement) and <|endoftext|> as a special
  token at andrea's EOT id. andrea reads a literal "<|endoftext|>" in text as ordinary text; the
  exported tokenizer_config.json asks transformers for the same (`split_special_tokens`). A HF
  tokenizer read here (`PretrainedTokenizer`) must be a byte-level BPE, so each id has a fixed
  byte string and decoding never fails, as with andrea's own.

References: transformers' GPT2Config and modeling_gpt2.py; the safetensors format (8-byte
little-endian header length, a JSON header of dtype, shape and data offsets, then the raw data).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import safetensors.numpy
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from andrea.config import ModelConfig
from andrea.data import MAX_VOCAB, atomic_writer
from andrea.errors import UserError
from andrea.tokenizer import BYTE_SYMBOLS, FORMAT, IdDecoding, Tokenizer
from minitensor.backend import to_numpy

EOT_TEXT = "<|endoftext|>"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# both names are the tanh approximation of GELU that andrea computes (SPEC 1)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_SYMBOL_TO_BYTE = {s: b for b, s in enumerate(BYTE_SYMBOLS)}
_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


# ----------------------------------------------------------------------------- configuration


def hf_config(cfg: ModelConfig, eot_id: int, dtype: str) -> dict:
    """config.json of a transformers GPT-2 computing what andrea does (no dropout: andrea has none)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.context_length,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.mlp_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.ln_eps,
        "tie_word_embeddings": True,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "dtype": dtype,
        "use_cache": True,
    }


def model_config_from_hf(hf: dict, source) -> ModelConfig:
    """andrea's ModelConfig for a transformers GPT-2 config.json; what andrea cannot compute is refused."""
    if hf.get("model_type") != "gpt2":
        raise UserError(f"{source} describes a {hf.get('model_type')!r} model; andrea reads GPT-2 (model_type gpt2)")
    refused = _unsupported(hf)
    if refused:
        raise UserError(f"{source} asks for what andrea's GPT-2 does not compute: {'; '.join(refused)}")
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            context_length=int(hf["n_positions"]),
            d_model=int(hf["n_embd"]),
            n_layer=int(hf["n_layer"]),
            n_head=int(hf["n_head"]),
            mlp_dim=int(hf["n_inner"]) if hf.get("n_inner") else None,
            ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
    except KeyError as e:
        raise UserError(f"{source} has no {e.args[0]!r}: is it a GPT-2 config.json?") from None


def _unsupported(hf: dict) -> list[str]:
    """What a GPT-2 config sets that andrea's model lacks, each named (GPT2Config's defaults assumed)."""
    refused = []
    activation = hf.get("activation_function", "gelu_new")
    if activation not in TANH_GELU:
        refused.append(f"activation_function {activation!r} (andrea computes the tanh GELU, gelu_new)")
    if not hf.get("tie_word_embeddings", True):
        refused.append("tie_word_embeddings false (an output head of its own; andrea's is the token embedding)")
    if not hf.get("scale_attn_weights", True):
        refused.append("scale_attn_weights false (attention without the 1/sqrt(head size) scale)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        refused.append("scale_attn_by_inverse_layer_idx true (attention scaled by 1/(layer + 1))")
    if hf.get("reorder_and_upcast_attn", False):
        refused.append("reorder_and_upcast_attn true")
    if hf.get("add_cross_attention", False):
        refused.append("add_cross_attention true (cross-attention to an encoder)")
    return refused


def read_model_config(directory) -> ModelConfig:
    directory = _directory(directory)
    return model_config_from_hf(_read_json(directory / "config.json"), directory / "config.json")


# ----------------------------------------------------------------------------- weights


def read_safetensors(path) -> dict[str, np.ndarray]:
    """{name: array} of a safetensors file, memory-mapped; float16 and bfloat16 become float32."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        n = int.from_bytes(mm[:8].tobytes(), "little")
        header = json.loads(mm[8:8 + n].tobytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not a readable safetensors file ({e})") from None
    base, tensors = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise UserError(f"{path}: tensor {name} has dtype {info['dtype']}; andrea reads floating-point weights")
        start, end = (base + o for o in info["data_offsets"])
        a = mm[start:end].view(_SAFETENSORS_DTYPES[info["dtype"]])
        if a.size != int(np.prod(info["shape"])) or end > mm.size:
            raise UserError(f"{path}: tensor {name} is cut short; the file is damaged")
        a = a.reshape(info["shape"])
        if info["dtype"] == "BF16":  # the top half of a float32
            a = (a.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = a
    return tensors


def _weight_files(directory: Path) -> list[Path]:
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    if (directory / WEIGHTS_INDEX).is_file():
        index = _read_json(directory / WEIGHTS_INDEX)
        return [directory / name for name in sorted(set(index.get("weight_map", {}).values()))]
    for pickled in ("pytorch_model.bin", "pytorch_model.bin.index.json"):
        if (directory / pickled).exists():
            raise UserError(
                f"{directory} holds {pickled}, a pickle, which andrea does not read: convert it once with "
                f"python -c \"from transformers import AutoModelForCausalLM as M; "
                f"M.from_pretrained('{directory}').save_pretrained('{directory}')\" (writes {WEIGHTS})"
            )
    raise UserError(f"{directory} has no {WEIGHTS}: give a directory written by save_pretrained")


def gpt2_state(tensors: dict, source) -> dict[str, np.ndarray]:
    """andrea's state dict from a GPT-2 checkpoint's tensors.

    A bare GPT2Model's names lack the `transformer.` prefix; older saves hold the causal mask as
    an `attn.bias` buffer (dropped); a `lm_head.weight` must be the token embedding itself.
    """
    state = {}
    for name, a in tensors.items():
        key = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        state[key] = a
    head = state.pop("lm_head.weight", None)
    wte = state.get("transformer.wte.weight")
    if head is not None and (wte is None or not np.array_equal(head, wte)):
        raise UserError(f"{source}: lm_head.weight differs from transformer.wte.weight, an untied output head, "
                        "which andrea's model does not have")
    return state


def load_pretrained(directory, device="cpu", dtype="float32"):
    """An ANDREA with the configuration and weights of a GPT-2 directory (andrea's export or transformers')."""
    from andrea.model import ANDREA  # the model's methods call into this module

    model = ANDREA(read_model_config(directory), device=device, dtype=dtype)
    load_weights(model, directory)
    return model


def load_weights(model, directory) -> None:
    """Copy a GPT-2 directory's weights into `model`, whose configuration must match them."""
    directory = _directory(directory)
    tensors = {}
    for path in _weight_files(directory):
        tensors.update(read_safetensors(path))
    model.load_state_dict(gpt2_state(tensors, directory))


def init_from_config(config, directory, overrides=()):
    """The run config `config` (a name or YAML path) with its model section from a GPT-2 directory.

    That is what train --init-from starts from. An override `model.KEY=VALUE` that disagrees
    with the directory's config is an error: the weights fix the model's shape.
    """
    from andrea.config import load_config, make_config

    imported = read_model_config(directory)
    shape = {"model": asdict(imported)}
    for item in (o for o in overrides if o.startswith("model.")):
        key = item.split("=", 1)[0]
        if make_config(shape, [item]).model != imported:
            raise UserError(f"--set {item} conflicts with {Path(directory) / 'config.json'} ({key} = "
                            f"{getattr(imported, key[6:])}): the imported weights fix the model's shape")
    cfg = load_config(config, [o for o in overrides if not o.startswith("model.")])
    cfg.model = imported
    cfg.train.validate(cfg.model)
    return cfg


def save_pretrained(model, directory, tokenizer=None) -> list[Path]:
    """Write config.json and model.safetensors (and the tokenizer's files when given); returns the paths."""
    directory = Path(directory)
    cfg = model.cfg
    if not cfg.is_gpt2:
        raise UserError(f"this model is a variant ({cfg.variant()}), not GPT-2: the Hugging Face export writes "
                        "GPT-2's block only (model.norm=pre, model.residual=true, model.activation=gelu)")
    if tokenizer is not None and tokenizer.vocab_size != cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids but the model {cfg.vocab_size}")
    eot_id = tokenizer.eot_id if tokenizer is not None else cfg.vocab_size - 1  # andrea's layout: EOT last
    dtype = np.dtype(model.dtype).name
    tensors = {name: np.ascontiguousarray(to_numpy(view)) for name, view in model.named_parameters()}
    files = {
        "config.json": _json_bytes(hf_config(cfg, eot_id, dtype)),
        "generation_config.json": _json_bytes({"bos_token_id": eot_id, "eos_token_id": eot_id}),
        WEIGHTS: safetensors.numpy.save(tensors, metadata={"format": "pt"}),  # transformers wants the tag
    }
    if tokenizer is not None:
        files.update(tokenizer_files(tokenizer, cfg.context_length))
    directory.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        with atomic_writer(directory / name) as f:
            f.write(blob)
    return [directory / name for name in files]


# ----------------------------------------------------------------------------- tokenizers


def tokenizer_files(tokenizer, context_length: int) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json for transformers' AutoTokenizer."""
    if isinstance(tokenizer, Tokenizer):
        text, eot = _hf_tokenizer(tokenizer).to_str(), EOT_TEXT
    else:
        text, eot = tokenizer.to_json(), tokenizer.eot_text
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        **special,
        "add_prefix_space": False,
        "add_bos_token": False,
        "split_special_tokens": True,  # a literal "<|endoftext|>" in text is text, as in andrea
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    return {"tokenizer.json": text.encode("utf-8"), "tokenizer_config.json": _json_bytes(config),
            "special_tokens_map.json": _json_bytes(special)}


def _hf_tokenizer(tok: Tokenizer) -> HFTokenizer:
    """andrea's BPE as a HF tokenizer: same ids, EOT a special token at tok.eot_id."""
    pieces = ["".join(BYTE_SYMBOLS[b] for b in tok.token_bytes(i)) for i in range(tok.eot_id)]
    merges = [(pieces[a], pieces[b]) for a, b in tok.merges]
    hf = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.post_processor = processors.ByteLevel(trim_offsets=False)
    hf.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    assert hf.token_to_id(EOT_TEXT) == tok.eot_id  # added after the model's ids, so it takes the next one
    return hf


class PretrainedTokenizer(IdDecoding):
    """andrea's tokenizer interface over a HF tokenizer.json of a byte-level BPE (GPT-2's kind).

    Encoding never yields the end-of-text id, as andrea's own tokenizer: special tokens in text
    are encoded as text. Decoding is a table lookup of each id's bytes, then UTF-8 with U+FFFD.
    """

    def __init__(self, text: str, source, eot_text: str | None = None):
        try:
            obj = json.loads(text)
            hf = HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises plain Exception on a malformed file
            raise UserError(f"{source} is not a readable tokenizer.json ({str(e).splitlines()[0]})") from None
        if (obj.get("model") or {}).get("type") != "BPE" or "ByteLevel" not in json.dumps(obj.get("pre_tokenizer")):
            raise UserError(f"{source} is not a byte-level BPE tokenizer (GPT-2's kind), which is what andrea reads")
        hf.encode_special_tokens = True
        self._hf, self._json = hf, hf.to_str()
        vocab = hf.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        if self.vocab_size > MAX_VOCAB:
            raise UserError(f"{source} has {self.vocab_size} ids, but token files store ids as uint16: "
                            f"andrea needs a tokenizer of at most {MAX_VOCAB} ids")
        added = {t["id"]: t for t in obj.get("added_tokens", [])}
        self.eot_text = eot_text or _end_of_text(added.values(), source)
        self.eot_id = vocab.get(self.eot_text)
        if self.eot_id is None or self.eot_id not in added:
            raise UserError(f"{source}: the end-of-text token {self.eot_text!r} is not one of its added tokens")
        self._token_bytes = [b""] * self.vocab_size
        for piece, i in vocab.items():
            self._token_bytes[i] = added[i]["content"].encode("utf-8") if i in added else _piece_bytes(piece, source)
        self._fingerprint = hashlib.sha256(self._json.encode("utf-8")).hexdigest()

    def to_json(self) -> str:
        return self._json

    def fingerprint(self) -> str:
        return self._fingerprint

    def save(self, path) -> None:
        with atomic_writer(path) as f:
            f.write(self._json.encode("utf-8"))

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]
        except TypeError:
            raise UserError("text to encode must be str that UTF-8 can represent (no lone surrogates)") from None

    def __repr__(self) -> str:
        return f"PretrainedTokenizer(vocab_size={self.vocab_size}, eot={self.eot_text!r})"


def _end_of_text(added_tokens, source) -> str:
    """<|endoftext|> when the tokenizer has it, else its only special token."""
    special = [t["content"] for t in added_tokens if t.get("special")]
    if EOT_TEXT in special:
        return EOT_TEXT
    if len(special) == 1:
        return special[0]
    raise UserError(f"{source}: cannot tell its end-of-text token among the special tokens {special[:5]}; "
                    "put a tokenizer_config.json with eos_token beside it")


def _piece_bytes(piece: str, source) -> bytes:
    try:
        return bytes(_SYMBOL_TO_BYTE[c] for c in piece)
    except KeyError:
        raise UserError(f"{source}: token {piece!r} is not byte-level BPE text (GPT-2's byte alphabet)") from None


def load_tokenizer(path):
    """andrea's Tokenizer from its own tokenizer.json, or a PretrainedTokenizer from a HF one.

    `path` is the JSON file or a directory holding tokenizer.json (with tokenizer_config.json's
    eos_token naming the end-of-text token, when there is one).
    """
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"tokenizer file {file} does not exist")
    try:
        text = file.read_text(encoding="utf-8")
        obj = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read tokenizer file {file}: {e}") from None
    if isinstance(obj, dict) and obj.get("format") == FORMAT:
        return Tokenizer.load(file)
    if not isinstance(obj, dict) or "model" not in obj:
        raise UserError(f"{file} is neither an andrea tokenizer nor a Hugging Face tokenizer.json")
    eos = None
    if (file.parent / "tokenizer_config.json").is_file():
        eos = _read_json(file.parent / "tokenizer_config.json").get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
    return PretrainedTokenizer(text, file, eos)


# ----------------------------------------------------------------------------- files


def _directory(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory: give a directory written by save_pretrained")
    return path


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} must hold a JSON object")
    return obj


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")
