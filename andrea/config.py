"""Configuration: the model, training and data sections of a YAML file, with command-line overrides.

    cfg = load_config("tiny", overrides=["train.lr=1e-3", "model.n_layer=2"])
    cfg.model.d_model, cfg.train.lr, cfg.data.data_dir

A config name (`tiny`, `small`, `120m`, `andrea-tiny`) resolves to the YAML files shipped inside
the package (andrea/configs/), so the defaults work without the repository; a path to a .yaml
file works too. Every mistake is a `UserError` naming the key and what is allowed: an unknown
key (with a "did you mean"), a wrong type, an impossible value.
"""

import difflib
import math
from dataclasses import InitVar, asdict, dataclass, field, fields
from decimal import Decimal, InvalidOperation
from pathlib import Path

import yaml

from andrea.data.request import check_val_fraction, default_data_dir
from andrea.errors import UserError, one_of
from andrea.model.block import check_norm
from andrea.run.schedule import check_schedule
from andrea.run.sinks import check_sink_names
from minitensor import precision
from minitensor.precision import POLICIES

CONFIG_DIR = Path(__file__).parent / "configs"


# the values model.norm_position and model.activation take (ModelConfig checks them). The names a
# registry holds (model.norm, train.schedule, train.log_to) are checked by the registry itself
# (andrea.model.block.check_norm, andrea.run.schedule.check_schedule, andrea.run.sinks.check_sink_names):
# nothing here lists them, so that a new member is its registry's entry alone
NORM_POSITIONS = ("pre", "post", "none")
ACTIVATIONS = ("gelu", "relu", "swiglu")
# train.precision's values: the policies a run trains in, float32 masters (float64 is train.dtype's, the checks')
PRECISIONS = tuple(name for name, policy in POLICIES.items() if policy.master == "float32")


class DerivedRatio(float):
    """A ratio ModelConfig derived (mlp_dim / d_model), not one it was given: dataclasses.replace hands
    it back as the mlp_ratio argument, where it counts as not given, so the width stays mlp_dim."""


@dataclass
class ModelConfig:
    vocab_size: int = 8449
    context_length: int = 1024
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    mlp_dim: int | None = None      # mlp_ratio * d_model when not given
    ln_eps: float = 1e-5
    # the design document's variants (docs/experiments.md); the defaults are ANDREA, GPT-2's block
    norm: str = "layernorm"         # the kind of norm: layernorm (GPT-2's) or another of andrea.model.block.NORMS
    norm_position: str | None = None  # pre (the default): x + f(N(x)); post: N(x + f(x)), the 2017
                                    # arrangement; none: x + f(x), no norm anywhere (the final one too).
                                    # A config or checkpoint written before the two were apart says
                                    # norm: pre, post or none, which means this with a LayerNorm
    residual: bool = True           # false: x = f(LN(x)) (pre) or LN(f(x)) (post), no skip
    activation: str = "gelu"        # gelu (GPT-2's tanh approximation), relu, or swiglu (a gated MLP)
    # the MLP's hidden width over d_model (4 unless this or mlp_dim is given; 8/3 for swiglu, rounded
    # to a whole width, the same parameter count as GELU's 4): an argument, not a
    # field, so a config is saved with the mlp_dim it gives (asdict leaves it out); self.mlp_ratio is
    # then mlp_dim / d_model, marked as derived (DerivedRatio)
    mlp_ratio: InitVar[float | None] = None

    def __post_init__(self, mlp_ratio):
        _require(self.d_model >= 1, f"model.d_model must be at least 1, got {self.d_model}")
        self.mlp_dim = self._hidden_width(None if isinstance(mlp_ratio, DerivedRatio) else mlp_ratio)
        self.mlp_ratio = DerivedRatio(self.mlp_dim / self.d_model)
        for name in ("vocab_size", "context_length", "d_model", "n_layer", "n_head", "mlp_dim"):
            _require(getattr(self, name) >= 1, f"model.{name} must be at least 1, got {getattr(self, name)}")
        _require(self.d_model % self.n_head == 0,
                 f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        _require(self.ln_eps > 0, f"model.ln_eps must be positive, got {self.ln_eps}")
        self._place_norm()
        _require(self.activation in ACTIVATIONS,
                 f"model.activation must be {one_of(ACTIVATIONS)}, got {self.activation!r}")

    def _place_norm(self):
        """Checks norm and norm_position. model.norm once was the position (pre, post, none), and
        configs and checkpoints of then say so: a norm of one of those values is read as that
        norm_position with a LayerNorm, which is what it meant (unless norm_position says otherwise)."""
        if self.norm in NORM_POSITIONS:
            _require(self.norm_position in (None, self.norm),
                     f"model.norm {self.norm!r} is the old spelling of model.norm_position, which says "
                     f"{self.norm_position!r}: give model.norm_position alone, and model.norm as the kind of "
                     "norm (layernorm, the default)")
            self.norm, self.norm_position = "layernorm", self.norm
        self.norm_position = self.norm_position or "pre"
        check_norm(self.norm, f" (where it goes is model.norm_position: {one_of(NORM_POSITIONS)})")
        _require(self.norm_position in NORM_POSITIONS,
                 f"model.norm_position must be {one_of(NORM_POSITIONS)}, got {self.norm_position!r}")

    def _hidden_width(self, ratio):
        """mlp_dim: as given; else mlp_ratio x d_model (4 x when neither is given), a whole number.
        Given both, they must agree: mlp_dim = mlp_ratio x d_model, or mlp_ratio = mlp_dim / d_model
        exactly as __post_init__ derives it (115 / 56 is no float that gives back 115 when multiplied:
        runs saved while the ratio was a field hold that float)."""
        if ratio is not None:
            _require(ratio > 0, f"model.mlp_ratio must be positive, got {ratio}")
            _require(math.isfinite(ratio * self.d_model), f"model.mlp_ratio ({ratio}) is too large")
        if self.mlp_dim is None and ratio is None and self.activation == "swiglu":
            return round(8 * self.d_model / 3)               # 3 C F = 8 C^2, GELU's 2 C (4 C)
        if self.mlp_dim is None:
            from_ratio = (4 if ratio is None else ratio) * self.d_model
            _require(from_ratio == int(from_ratio),
                     f"model.mlp_ratio ({ratio}) x model.d_model ({self.d_model}) must be a whole number")
            return int(from_ratio)
        _require(ratio is None or ratio * self.d_model == self.mlp_dim or self.mlp_dim / self.d_model == ratio,
                 f"model.mlp_dim ({self.mlp_dim}) and model.mlp_ratio ({ratio}) disagree (mlp_dim = mlp_ratio x "
                 "d_model): give only one of them")
        return self.mlp_dim

    @property
    def is_gpt2(self):
        """Whether this is GPT-2's block (pre-norm LayerNorm, residual, GELU), which the Hugging Face
        export writes."""
        return self.variant() == ""

    def variant(self):
        """The non-GPT-2 choices, e.g. "norm_position=post, residual=false" ("" for GPT-2's block)."""
        changed = [f"norm_position={self.norm_position}"] if self.norm_position != "pre" else []
        changed += [f"norm={self.norm}"] if self.norm != "layernorm" and self.norm_position != "none" else []
        changed += ["residual=false"] if not self.residual else []
        changed += [f"activation={self.activation}"] if self.activation != "gelu" else []
        return ", ".join(changed)

    @property
    def head_size(self):
        return self.d_model // self.n_head


@dataclass
class TrainConfig:
    batch_size: int = 16            # sequences per micro-batch
    seq_len: int = 0                # tokens per sequence; 0 means the model's context_length
    tokens_per_step: int = 0        # optimizer batch in tokens (gradient accumulation); 0 = one micro-batch
    max_steps: int = 500
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    schedule: str = "cosine"        # a schedule of andrea.run.schedule.SCHEDULES (cosine by default)
    decay_fraction: float = 0.2     # wsd: the share of max_steps its final linear decay takes
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0          # 0 disables clipping
    log_interval: int = 10
    log_to: list = field(default_factory=list)  # metrics sinks beside metrics.jsonl (andrea.run.sinks.SINKS)
    log_grad_flow: bool = False     # per-block gradient and residual-stream norms at log steps (andrea.run.gradflow)
    eval_interval: int = 100
    eval_batches: int = 8
    checkpoint_interval: int = 200
    keep_last: int = 3
    max_bad_steps: int = 5          # non-finite steps in a row before training stops
    check_collectives: bool = False  # debugging several processes: compare each collective across ranks first
    zero_stage: int = 0             # 1: ZeRO-1, the optimizer's state sharded over the processes (docs/distributed.md)
    overlap: bool = True            # several processes: each block's gradients reduce while the backward goes on
    seed: int = 0
    device: str = "auto"
    dtype: str = "float32"
    precision: str = "float32"      # bf16 on a GPU: float32 master weights, bfloat16 activations (minitensor.precision)
    tf32: bool = False
    kernels: str = "auto"           # fused GPU kernels: auto (self-checked at start-up), fused, or generic
    sample_tokens: int = 120        # length of the sample printed at the end (0: none)
    sample_prompt: str = "def "

    def validate(self, model):
        for name in ("batch_size", "max_steps", "log_interval", "eval_interval", "eval_batches",
                     "checkpoint_interval", "keep_last", "max_bad_steps"):
            _require(getattr(self, name) >= 1, f"train.{name} must be at least 1, got {getattr(self, name)}")
        _require(self.lr > 0, f"train.lr must be positive, got {self.lr}")
        _require(0 <= self.min_lr <= self.lr, f"train.min_lr must be in [0, train.lr], got {self.min_lr} with "
                 f"train.lr {self.lr:g}: a lower train.lr needs a lower min_lr too, e.g. --set "
                 f"train.min_lr={self.lr / 10:g}")
        _require(self.warmup_steps >= 0, f"train.warmup_steps must be >= 0, got {self.warmup_steps}")
        check_schedule(self.schedule)
        check_sink_names(self.log_to)
        _require(0 < self.decay_fraction <= 1, f"train.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        _require(self.weight_decay >= 0, f"train.weight_decay must be >= 0, got {self.weight_decay}")
        _require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
        _require(self.eps > 0, f"train.eps must be positive, got {self.eps}")
        _require(self.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.grad_clip}")
        _require(self.seq_len >= 0, f"train.seq_len must be >= 0, got {self.seq_len}")
        _require(0 <= self.seed < 2**63, f"train.seed must be in [0, 2^63), got {self.seed}")
        _require(self.sample_tokens >= 0, f"train.sample_tokens must be >= 0, got {self.sample_tokens}")
        _require(self.seq_len <= model.context_length,
                 f"train.seq_len ({self.seq_len}) exceeds model.context_length ({model.context_length}), "
                 "the size of the position table")
        _require(self.device in ("auto", "cpu", "gpu"), f"train.device must be auto, cpu or gpu, got {self.device!r}")
        _require(self.dtype in precision.FLOATS, f"train.dtype must be {' or '.join(precision.FLOATS)}, got {self.dtype!r}")
        _require(self.zero_stage in (0, 1), f"train.zero_stage must be 0 (replicated) or 1 (the optimizer's state "
                 f"sharded), got {self.zero_stage}")
        _require(self.precision in PRECISIONS, f"train.precision must be {' or '.join(PRECISIONS)}, got "
                 f"{self.precision!r} (the float64 checks are train.dtype=float64)")
        if self.precision != "float32":
            _require(self.dtype == "float32", f"train.precision={self.precision} keeps float32 master weights: "
                     f"leave train.dtype at float32, not {self.dtype}")
            _require(self.zero_stage == 0, f"train.precision={self.precision} with train.zero_stage=1 is not built "
                     "yet (each rank's AdamW writes only its range of the bfloat16 weights, and the all-gather "
                     "gathers the float32 ones): use train.zero_stage=0")
        _require(self.kernels in ("auto", "fused", "generic"),
                 f"train.kernels must be auto, fused or generic, got {self.kernels!r}")
        micro = self.batch_size * self.sequence_length(model)
        _require(self.tokens_per_step == 0 or self.tokens_per_step % micro == 0,
                 f"train.tokens_per_step ({self.tokens_per_step}) must be a multiple of "
                 f"batch_size x seq_len ({micro})")

    def sequence_length(self, model):
        return self.seq_len or model.context_length

    def accumulation_steps(self, model):
        micro = self.batch_size * self.sequence_length(model)
        return max(1, self.tokens_per_step // micro) if self.tokens_per_step else 1


@dataclass
class DataConfig:
    inputs: list = field(default_factory=list)   # files, directories or globs; empty: the Python stdlib
    data_dir: str = ""                            # where tokens and tokenizer live; "" = data/<name>, as prepare's
    val_fraction: float | None = None             # held out for validation; None: the data's own, or the default
    allow_smaller_vocab: bool = False             # a small corpus may run out of merges before 8449 ids
    text_field: str = ""                          # inputs are JSON Lines, one document a line, this field's text

    def validate(self):
        if self.val_fraction is not None:
            check_val_fraction(self.val_fraction, "data.val_fraction")
        if isinstance(self.inputs, str):
            self.inputs = [self.inputs]

    def resolved_dir(self):  # data.data_dir, or the one `prepare` writes for the same inputs (andrea.data.request)
        return Path(self.data_dir) if self.data_dir else default_data_dir(self.inputs)


@dataclass
class Config:
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    name: str = "custom"

    def to_dict(self):
        return {"name": self.name, "model": asdict(self.model), "train": asdict(self.train),
                "data": asdict(self.data)}


SECTIONS = {"model": ModelConfig, "train": TrainConfig, "data": DataConfig}


def _require(ok, message):
    if not ok:
        raise UserError(message)


def config_path(name):
    """A shipped config by short or full name, or a path to a YAML file."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if p.is_dir():
            raise UserError(f"config {name} is a directory: give a .yaml file")
        if not p.is_file():
            raise UserError(f"config file {name} does not exist")
        return p
    if not name:
        raise UserError("--config is empty: give tiny, small, 120m or a path to a .yaml file")
    shipped = sorted(f.stem for f in CONFIG_DIR.glob("*.yaml"))
    for candidate in (name, f"andrea-{name}"):
        if candidate in shipped:
            return CONFIG_DIR / f"{candidate}.yaml"
    raise UserError(f"unknown config {name!r}: use one of {', '.join(shipped)} or a path to a .yaml file")


def _did_you_mean(key, options):
    close = difflib.get_close_matches(str(key), options, n=1)  # YAML keys may be numbers
    return f" (did you mean {close[0]!r}?)" if close else ""


def _to_bool(value):
    """A YAML boolean, or true/yes/1/on or false/no/0/off in any case."""
    if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
        return True
    if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
        return False
    if isinstance(value, bool):
        return value
    raise ValueError


def _to_int(value):
    """A whole number, or a string of one ("2e3" too); a boolean is not one. A string is read as an
    exact decimal, never through a float: 9007199254740993 stays itself (a float holds ...992)."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, str):
        try:
            number = Decimal(value.strip())
        except InvalidOperation:  # no number at all
            raise ValueError from None
        # "1e999999999" is a whole number too, which int() would spend minutes writing out
        if not number.is_finite() or number.adjusted() > 100 or number != number.to_integral_value():
            raise ValueError
        return int(number)
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise ValueError
    return int(value)


def _to_float(value):
    """A finite number, or a string of one; a boolean is not one."""
    if isinstance(value, bool):
        raise ValueError
    number = float(value)
    if not math.isfinite(number):
        raise ValueError
    return number


def _to_list(value):
    """A YAML list of strings, or one comma-separated string (empty items dropped)."""
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ValueError


def _to_str(value):
    """A string, or a number written as one."""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError
    return str(value)


# A field's kind is the first of these names its type mentions (`list[str]` mentions str too, so list
# comes before str): the converter a value goes through, and what the error says the value must be.
KINDS = (
    ("bool", _to_bool, "true or false"),
    ("int", _to_int, "an integer"),
    ("float", _to_float, "a number"),
    ("list", _to_list, "a list of strings"),
    ("str", _to_str, "a string"),
)


def _coerce(section, key, value, kind):
    """Converts value (from YAML or a command-line string) to the field's type, or explains why not."""
    if value is None and "None" in str(kind):
        return None
    convert = next((convert for name, convert, _ in KINDS if name in str(kind)), None)
    if convert is not None:
        try:
            return convert(value)
        except (TypeError, ValueError):
            pass
    raise UserError(f"{section}.{key} must be {_type_name(kind)}, got {value!r}")


def _type_name(kind):
    return next((said for name, _, said in KINDS if name in str(kind)), str(kind))


def section_keys(cls):
    """{key: its type} of a section: its fields, and its arguments that are no fields (mlp_ratio)."""
    arguments = {name: kind for name, kind in cls.__annotations__.items() if isinstance(kind, InitVar)}
    return {f.name: f.type for f in fields(cls)} | arguments


def _apply(values, section, data):
    known = section_keys(SECTIONS[section])
    for key, value in data.items():
        if key not in known:
            raise UserError(f"unknown key {section}.{key}{_did_you_mean(key, list(known))}")
        values[section][key] = _coerce(section, key, value, known[key])


def load_config(name="tiny", overrides=()):
    """Reads a config (shipped name or path) and applies `section.key=value` overrides, then validates."""
    path = config_path(name)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read config {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise UserError(f"config {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from e
    except yaml.YAMLError as e:
        raise UserError(f"config {path} is not valid YAML: {_yaml_problem(e)}") from e
    if raw is None:  # an empty file is a mistake (a wrong path, a cut write), not "every default": 124M parameters
        raise UserError(f"config {path} is empty: give at least one of its sections model, train, data (a "
                        "config file's missing keys take ModelConfig's defaults, GPT-2 small's); without "
                        "--config the run is tiny")
    if not isinstance(raw, dict):
        raise UserError(f"config {path} must be a mapping with sections model, train, data")
    return make_config(raw, overrides, name=path.stem, source=str(path))


def _yaml_problem(e):
    """PyYAML's problem with its line and column (1-based), on one line."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def make_config(raw, overrides=(), name=None, source="the config"):
    """A validated Config from {section: {key: value}} (YAML or JSON values) plus overrides; its name
    is `name`, else raw's own (a saved config.json's), else "custom"."""
    name = name if name is not None else str(raw.get("name", "custom"))
    values = {s: {} for s in SECTIONS}
    for section, data in raw.items():
        if section == "name":
            continue
        if section not in SECTIONS:
            raise UserError(f"unknown section {section!r} in {source}{_did_you_mean(section, list(SECTIONS))}")
        if not isinstance(data, dict):
            raise UserError(f"section {section!r} in {source} must be a mapping")
        _apply(values, section, data)
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"override {item!r} must look like section.key=value (e.g. train.lr=1e-3)")
        key, value = item.split("=", 1)
        section, key = key.split(".", 1)
        if section not in SECTIONS:
            raise UserError(f"unknown section {section!r} in override {item!r}{_did_you_mean(section, list(SECTIONS))}")
        _apply(values, section, {key: value})
    return build_config(values, name=name)


def saved_model_config(values: dict) -> dict:
    """The model section of a saved run (its config.json, a checkpoint's meta) as this andrea builds
    it, for comparing with a run's own: the derived values (mlp_dim, mlp_ratio) are derived again, as
    for the run's config."""
    return make_config({"model": values}).to_dict()["model"]


def build_config(values, name="custom"):
    """A validated Config from {"model": {...}, "train": {...}, "data": {...}} (missing keys default)."""
    model = ModelConfig(**values.get("model", {}))
    train = TrainConfig(**values.get("train", {}))
    data = DataConfig(**values.get("data", {}))
    train.validate(model)
    data.validate()
    return Config(model, train, data, name=name)
