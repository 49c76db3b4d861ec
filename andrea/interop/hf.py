"""The Hugging Face format, both ways: a GPT-2 directory that transformers loads, and one andrea loads.

    model.save_pretrained("export/", tokenizer=tok)   # config.json, model.safetensors, tokenizer files
    model = ANDREA.from_pretrained("export/")         # or a GPT-2 saved by transformers (safetensors)
    state = read_state("export/", param_shapes(cfg))  # the checked weights alone, {GPT-2 name: array}
    tok = load_tokenizer("export/")                   # andrea.data.tokenizer: andrea's tokenizer.json or a HF one

andrea's parameters already carry GPT2LMHeadModel's state-dict names in its Conv1D (in, out) layout
(andrea.model.sizes.param_shapes), so the weights are copied name for name. What this module adds:

- the configuration: n_positions <-> context_length, n_embd <-> d_model, n_inner <-> mlp_dim,
  layer_norm_epsilon <-> ln_eps; what GPT-2's configuration can say and andrea cannot compute
  (another activation, an untied head, the scaled-attention variants) is refused by name;
- the weights file: safetensors only (a pickled pytorch_model.bin is refused with the command that
  converts it), read by a small reader of its own so bfloat16 and float16 files load too;
- trust in nothing read: config.json's values are type-checked (a size is a whole number, never
  truncated), a safetensors header is checked against the file's length before any tensor is
  read, a sharded index's files must all be there, and the weights must have the config's names
  and shapes and be finite, all before a model is built (read_state); a UserError names the file;
- the tokenizer in HF's tokenizer.json form: andrea's byte-level BPE becomes a HF BPE model with
  the ByteLevel pre-tokenizer and decoder (GPT-2's own arrangement) and <|endoftext|> as a special
  token at andrea's EOT id. andrea reads a literal "<|endoftext|>" in text as ordinary text; the
  exported tokenizer_config.json asks transformers for the same (`split_special_tokens`). A HF
  tokenizer read by andrea (andrea.data.tokenizer.PretrainedTokenizer) must be a byte-level BPE, so
  each id has a fixed byte string and decoding never fails, as with andrea's own.

The model calls into this module (ANDREA.from_pretrained, save_pretrained) and never the other way:
what is model-specific (the parameter shapes to expect) comes in as an argument.

References: transformers' GPT2Config and modeling_gpt2.py; the safetensors format (8-byte
little-endian header length, a JSON header of dtype, shape and data offsets, then the raw data).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import numpy as np
import safetensors.numpy
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from andrea.config import ModelConfig
from andrea.data.tokenizer import BYTE_SYMBOLS, Tokenizer
from andrea.errors import UserError
from andrea.files import atomic_writer, read_json
from minitensor.device import to_numpy

EOT_TEXT = Tokenizer.EOT_TEXT
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# both names are the tanh approximation of GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
# which andrea computes (minitensor.backends.ops)
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
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
    """andrea's ModelConfig for a transformers GPT-2 config.json; what andrea cannot compute is refused.

    Every value is checked for its type before use: a size must be a whole number of at least 1
    (1.5 is not truncated to 1), the epsilon a positive finite number, the switches true or false.
    """
    if hf.get("model_type") != "gpt2":
        raise UserError(f"{source} describes a {hf.get('model_type')!r} model; andrea reads GPT-2 (model_type gpt2)")
    for key, kind in _CONFIG_TYPES.items():
        if key in hf and not (hf[key] is None and key == "n_inner"):
            _check_value(hf[key], kind, f"{source}: {key}")
    refused = _unsupported(hf)
    if refused:
        raise UserError(f"{source} asks for what andrea's GPT-2 does not compute: {'; '.join(refused)}")
    missing = [key for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if key not in hf]
    if missing:
        raise UserError(f"{source} has no {missing[0]!r}: is it a GPT-2 config.json?")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            context_length=hf["n_positions"],
            d_model=hf["n_embd"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            mlp_dim=hf.get("n_inner"),
            ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
    except UserError as e:  # the sizes do not fit together (n_embd not divisible by n_head)
        raise UserError(f"{source}: {e}") from None


# the keys read from a GPT-2 config.json and the type each must have
_CONFIG_TYPES = {
    "model_type": "text", "activation_function": "text",
    "vocab_size": "size", "n_positions": "size", "n_embd": "size", "n_layer": "size", "n_head": "size",
    "n_inner": "size", "layer_norm_epsilon": "positive",
    "tie_word_embeddings": "switch", "scale_attn_weights": "switch", "scale_attn_by_inverse_layer_idx": "switch",
    "reorder_and_upcast_attn": "switch", "add_cross_attention": "switch",
}


def _check_value(value, kind: str, what: str) -> None:
    if kind == "size":
        ok, wanted = type(value) is int and value >= 1, "a whole number of at least 1"
    elif kind == "positive":
        ok = type(value) in (int, float) and math.isfinite(value) and value > 0
        wanted = "a positive finite number"
    elif kind == "switch":
        ok, wanted = type(value) is bool, "true or false"
    else:
        ok, wanted = type(value) is str, "a string"
    if not ok:
        raise UserError(f"{what} must be {wanted}, got {json.dumps(value)[:40]}")


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
    return model_config_from_hf(read_json(directory / "config.json"), directory / "config.json")


# ----------------------------------------------------------------------------- weights


def read_safetensors(path) -> dict[str, np.ndarray]:
    """{name: array} of a safetensors file, memory-mapped; float16 and bfloat16 become float32.

    The header is checked whole before any tensor is read: its length against the file's, each
    entry's dtype, shape and data offsets against each other and the file's end, so an empty,
    truncated (an interrupted download) or malformed file is one UserError naming it.
    """
    path = Path(path)
    size = path.stat().st_size
    damaged = f"{path} is not a complete safetensors file"
    if size < 8:
        raise UserError(f"{damaged}: it has {size} bytes (an interrupted download?); download or save it again")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    n = int.from_bytes(mm[:8].tobytes(), "little")
    if n > size - 8:
        raise UserError(f"{damaged}: its header claims {n} bytes of a {size}-byte file (an interrupted download?)")
    try:
        header = json.loads(mm[8:8 + n].tobytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{damaged}: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise UserError(f"{damaged}: its header is not a JSON object")
    base, tensors = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = _tensor_entry(info, f"{path}: tensor {name}", size - base)
        a = mm[base + start:base + end].view(dtype).reshape(shape)
        if info["dtype"] == "BF16":  # the top half of a float32
            a = (a.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = a
    return tensors


def _tensor_entry(info, what: str, data_bytes: int):
    """(NumPy dtype, shape, (start, end)) of one header entry, each checked against the others."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise UserError(f"{what} lacks a dtype, shape or data_offsets: the file is damaged")
    if info["dtype"] not in _SAFETENSORS_DTYPES:
        raise UserError(f"{what} has dtype {info['dtype']}; andrea reads floating-point weights")
    shape, offsets = info["shape"], info["data_offsets"]
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise UserError(f"{what} has a malformed shape {shape!r} or data_offsets {offsets!r}: the file is damaged")
    dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
    start, end = offsets
    if not 0 <= start <= end or end - start != math.prod(shape) * dtype.itemsize:
        raise UserError(f"{what}: its data_offsets {offsets} do not hold a {shape} {info['dtype']} tensor")
    if end > data_bytes:
        raise UserError(f"{what} is cut short: the file ends before its data (an interrupted download?)")
    return dtype, tuple(shape), (start, end)


def _weight_files(directory: Path) -> list[Path]:
    if (directory / WEIGHTS).is_file():
        return [directory / WEIGHTS]
    if (directory / WEIGHTS_INDEX).is_file():
        index = read_json(directory / WEIGHTS_INDEX)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserError(f"{directory / WEIGHTS_INDEX} has no weight_map of tensor names to file names")
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in shards if not p.is_file()]
        if missing or not shards:
            raise UserError(f"{directory / WEIGHTS_INDEX} names {', '.join(missing[:3]) or 'no shard'}, which "
                            f"{'is' if len(missing) == 1 else 'are'} not in {directory}: download the missing "
                            "files again")
        return shards
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


def read_state(directory, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """andrea's state dict from a GPT-2 directory's weights, checked before anything is loaded:
    the files' headers, one tensor of the expected shape for each name of `shapes` (the model's
    param_shapes) and nothing else, and every value finite (a NaN would train into NaN checkpoints)."""
    directory = _directory(directory)
    tensors = {}
    for path in _weight_files(directory):
        tensors.update(read_safetensors(path))
    state = gpt2_state(tensors, directory)
    missing = [name for name in shapes if name not in state]
    unknown = [name for name in state if name not in shapes]
    if missing or unknown:
        raise UserError(f"the weights in {directory} do not fit its config.json: "
                        + "; ".join(f"{what} {', '.join(names[:3])}" for what, names in
                                    (("missing", missing), ("unexpected", unknown)) if names))
    for name, shape in shapes.items():
        if tuple(state[name].shape) != tuple(shape):
            raise UserError(f"{directory}: {name} has shape {tuple(state[name].shape)}, but its config.json "
                            f"makes it {tuple(shape)}")
    for name, a in state.items():
        if not np.isfinite(a).all():
            raise UserError(f"{directory}: {name} holds {_non_finite(a)}: the weights are damaged (training "
                            "from them gives NaN); download or export them again")
    return state


def _non_finite(a) -> str:
    n_nan, n_inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
    return " and ".join(f"{n} {what}" for n, what in ((n_nan, "NaN"), (n_inf, "infinite value(s)")) if n)


def load_weights(model, directory) -> None:
    """Copy a GPT-2 directory's weights into `model`, whose configuration must match them."""
    model.load_state_dict(read_state(directory, model.params.shapes))


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
    # the train overrides are checked against the imported model (a seq_len above the config's own
    # context is fine when the GPT-2's is larger), so the model section is swapped before they apply
    values = load_config(config).to_dict()
    values["model"] = asdict(imported)
    return make_config(values, [o for o in overrides if not o.startswith("model.")], name=values["name"],
                       source=str(Path(directory) / "config.json"))


def check_exportable(cfg: ModelConfig, tokenizer=None) -> None:
    """A UserError when a GPT-2 directory cannot hold this model (a variant's block) or its tokenizer
    (more ids than the model has: fewer is a padded vocabulary, which transformers loads too)."""
    if not cfg.is_gpt2:
        raise UserError(f"this model is a variant ({cfg.variant()}), not GPT-2: the Hugging Face export writes "
                        "GPT-2's block only (model.norm=layernorm, model.norm_position=pre, model.residual=true, "
                        "model.activation=gelu)")
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}")


def save_pretrained(model, directory, tokenizer=None) -> list[Path]:
    """Write config.json and model.safetensors (and the tokenizer's files when given); returns the paths."""
    directory = Path(directory)
    cfg = model.cfg
    check_exportable(cfg, tokenizer)
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


# ----------------------------------------------------------------------------- files


def _directory(path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory: give a directory written by save_pretrained")
    return path


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")
