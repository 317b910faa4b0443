"""Frozen, self-validating configuration sections loaded from plain mappings."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

LORA_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
    "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj",
)
EMBEDDED = "embedded"
CHOICE_ORDERS = ("hashed", "given")
IMAGE_LAYOUTS = ("inline", "front")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class EmbeddedShape:
    """Shape of the tiny Qwen3.5-architecture base the project builds itself."""

    hidden_size: int = 64
    intermediate_size: int = 128
    layer_types: tuple[str, ...] = ("linear_attention",) * 3 + ("full_attention",)
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 2
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    vision_depth: int = 2
    vision_hidden_size: int = 32
    vision_heads: int = 2
    vision_intermediate_size: int = 64
    patch_size: int = 16
    vocab_size: int = 2048

    def __post_init__(self):
        kinds = set(self.layer_types)
        _check(kinds <= {"linear_attention", "full_attention"} and len(kinds) == 2,
               f"model.embedded.layer_types must mix linear_attention and full_attention, got {self.layer_types}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"model.embedded: {self.num_attention_heads} attention heads not divisible by "
               f"{self.num_key_value_heads} key/value heads")
        _check(self.head_dim % 8 == 0, f"model.embedded.head_dim must be a multiple of 8, got {self.head_dim}")
        _check(self.vocab_size >= 512, f"model.embedded.vocab_size must be >= 512, got {self.vocab_size}")


@dataclass(frozen=True)
class ModelConfig:
    """The base model and the fixed preprocessing policy."""

    base: str = EMBEDDED
    revision: str | None = None
    dtype: str = "float32"
    marker_token: str = "<|fim_suffix|>"
    image_pixels: int = 64 * 64
    max_tokens: int = 32768  # a row: the state and one question with its candidates (the wire format's budget)
    max_request_tokens: int = 65536  # a request: its state once and every question
    seed: int = 0
    # How a choice's options are laid out: "hashed" renders them by a salted hash of their text,
    # so the order a client sends cannot change an answer (`inputs.template.rendered_order`);
    # "given" keeps the client's order (checkpoints made before the setting existed).
    choice_order: str = "hashed"
    choice_salt: str = "dohnuts-choice-1"
    # Where an image's vision block goes: "inline" at its place in the state's text, "front"
    # before the state (checkpoints made before the setting existed, which took one image).
    image_layout: str = "inline"
    max_images: int = 8  # images a state may hold
    embedded: EmbeddedShape = field(default_factory=EmbeddedShape)

    def __post_init__(self):
        _check(self.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16, got {self.dtype!r}")
        _check(self.choice_order in CHOICE_ORDERS,
               f"model.choice_order must be one of {CHOICE_ORDERS}, got {self.choice_order!r}")
        _check(1 <= len(self.choice_salt.encode()) <= 64,
               f"model.choice_salt must be 1 to 64 bytes (a hash key), got {self.choice_salt!r}")
        _check(self.image_layout in IMAGE_LAYOUTS,
               f"model.image_layout must be one of {IMAGE_LAYOUTS}, got {self.image_layout!r}")
        _check(self.max_images >= 1, f"model.max_images must be >= 1, got {self.max_images}")
        _check(self.image_pixels >= 32 * 32, f"model.image_pixels must be >= 1024, got {self.image_pixels}")
        _check(self.max_tokens >= 16 and self.max_request_tokens >= self.max_tokens,
               f"model.max_tokens must be >= 16 and max_request_tokens >= max_tokens, got {self.max_tokens}, "
               f"{self.max_request_tokens}")
        if self.base != EMBEDDED:
            _check(self.revision is not None,
                   f"model.base {self.base!r} is a Hub id: pin model.revision to a commit hash")

    @property
    def order_salt(self) -> str | None:
        """The salt of a choice's rendered order, or None where options keep the given order."""
        return self.choice_salt if self.choice_order == "hashed" else None


@dataclass(frozen=True)
class LoraConfig:
    """LoRA on the language model only."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        _check(self.rank >= 1, f"lora.rank must be >= 1, got {self.rank}")
        _check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = set(self.targets) - set(LORA_TARGETS)
        _check(not unknown, f"lora.targets has unknown modules {sorted(unknown)}; known: {LORA_TARGETS}")


DATA_SOURCES = ("synthetic", "records", "public")


@dataclass(frozen=True)
class DataConfig:
    """Where the decision records come from, and their partitions.

    `source: synthetic` generates the embedded mixture (`seed`, `states_per_group`,
    `image_size`); `source: records` reads the user's decision records (JSONL or Parquet) from
    `path`, a file or a folder (`dohnuts.data.user_records`), and `skip_invalid` drops invalid
    records (counted) instead of failing on them; `source: public` converts the upstream public
    mixture (`dohnuts.data.public`) from the raw files in `cache` (null: the Hugging Face
    cache), its `groups` (empty: all 26), reading at most `public_pool` hashed rows a group.
    `guard` names a file of text fingerprints (`dohnuts.data.guard`) whose rows leave every
    partition, whatever the source. A group with no test rows fails `prepare` (it would never be
    scored) unless `allow_untested_groups`.
    """

    source: str = "synthetic"
    path: str = "data/records"
    skip_invalid: bool = False
    seed: int = 0
    states_per_group: int = 400
    image_size: int = 64
    partitions: dict = field(default_factory=lambda: {"train": 0.7, "dev": 0.1, "calibration": 0.1, "test": 0.1})
    cache: str | None = None
    groups: tuple[str, ...] = ()
    public_pool: int = 12000
    guard: str | None = None
    allow_untested_groups: bool = False

    def __post_init__(self):
        _check(self.source in DATA_SOURCES, f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        _check(bool(self.path), "data.path must name a file or a folder of decision records")
        _check(self.states_per_group >= 8, f"data.states_per_group must be >= 8, got {self.states_per_group}")
        _check(set(self.partitions) == {"train", "dev", "calibration", "test"},
               f"data.partitions must name train, dev, calibration and test, got {sorted(self.partitions)}")
        _check(all(value > 0 for value in self.partitions.values()),
               f"data.partitions fractions must be positive, got {self.partitions}")
        _check(self.public_pool >= 0, f"data.public_pool must be >= 0 (0: every row), got {self.public_pool}")
        _check(not self.groups or self.source == "public",
               f"data.groups selects public groups; it must be empty for data.source {self.source!r}")


@dataclass(frozen=True)
class ObjectiveConfig:
    """RLCD + cross-entropy constants."""

    samples: int = 4
    sigma: float = 0.3
    log_weight: float = 1.0
    spherical_weight: float = 0.75
    ordinal_weight: float = 1.0
    log_floor: float = -9.21
    ce_weight: float = 1.0

    def __post_init__(self):
        _check(self.samples >= 2, f"train.objective.samples must be >= 2, got {self.samples}")
        _check(self.sigma > 0, f"train.objective.sigma must be > 0, got {self.sigma}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule, sampling and checkpointing."""

    steps: int = 600
    rows_per_microbatch: int = 8
    microbatches_per_update: int = 4
    lora_lr: float = 1e-4
    head_lr: float = 5e-4
    weight_decay: float = 0.01
    horizon_cap: int = 2400
    warmup_fraction: float = 0.03
    lr_floor: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 400
    max_tokens: int = 2048
    group_cap: int = 6000
    activation_checkpointing: bool = True
    head_init_std: float = 0.01
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    def __post_init__(self):
        _check(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        _check(self.eval_every >= 1, f"train.eval_every must be >= 1, got {self.eval_every}")
        _check(self.rows_per_microbatch >= 1 and self.microbatches_per_update >= 1,
               f"train.rows_per_microbatch and microbatches_per_update must be >= 1, got "
               f"{self.rows_per_microbatch}, {self.microbatches_per_update}")
        _check(self.lora_lr > 0 and self.head_lr > 0,
               f"train learning rates must be > 0, got {self.lora_lr}, {self.head_lr}")
        _check(0.0 < self.lr_floor <= 1.0, f"train.lr_floor must be in (0, 1], got {self.lr_floor}")
        _check(self.grad_clip > 0, f"train.grad_clip must be > 0, got {self.grad_clip}")
        _check(self.group_cap >= 1 and self.max_tokens >= 16,
               f"train.group_cap must be >= 1 and max_tokens >= 16, got {self.group_cap}, {self.max_tokens}")


# Computed tokens an evaluation batch holds (select, calibrate, test): whole requests up to this.
EVALUATION_BATCH_TOKENS = 16384


@dataclass(frozen=True)
class SelectConfig:
    """Selection on the dev partition."""

    dev_rows_per_group: int = 256
    batch_tokens: int = EVALUATION_BATCH_TOKENS

    def __post_init__(self):
        _check(self.dev_rows_per_group >= 1 and self.batch_tokens >= 1,
               f"select.dev_rows_per_group and batch_tokens must be >= 1, got "
               f"{self.dev_rows_per_group}, {self.batch_tokens}")


@dataclass(frozen=True)
class CalibrateConfig:
    """The calibrator's fit (`scoring.calibrator`): cells of at least `min_rows` rows, LBFGS `lr`
    and `iterations`, temperature bounds, `folds` over states to choose each type's family; and
    abstention thresholds at each of `risks`, each bound holding with probability 1 - `delta`."""

    min_rows: int = 10
    lr: float = 0.1
    iterations: int = 100
    min_temperature: float = 0.1
    max_temperature: float = 10.0
    batch_tokens: int = EVALUATION_BATCH_TOKENS
    folds: int = 5
    risks: tuple[float, ...] = (0.01, 0.05, 0.1)
    delta: float = 0.1

    def __post_init__(self):
        _check(self.min_rows >= 1 and self.iterations >= 1 and self.lr > 0 and self.batch_tokens >= 1,
               f"calibrate.min_rows, iterations and batch_tokens must be >= 1 and lr > 0, got "
               f"{self.min_rows}, {self.iterations}, {self.batch_tokens}, {self.lr}")
        _check(self.folds >= 2, f"calibrate.folds must be >= 2, got {self.folds}")
        _check(all(0 < risk < 1 for risk in self.risks) and 0 < self.delta < 1,
               f"calibrate.risks and delta must lie in (0, 1), got {list(self.risks)}, {self.delta}")
        _check(0 < self.min_temperature < self.max_temperature,
               f"calibrate temperature bounds must satisfy 0 < min < max, got "
               f"{self.min_temperature}, {self.max_temperature}")


@dataclass(frozen=True)
class TestConfig:
    """Evaluation on the test partition."""

    batch_tokens: int = EVALUATION_BATCH_TOKENS
    audit_states: int = 200  # requests the audits ask again (`pipeline.audits`), taken in turn from each group

    def __post_init__(self):
        _check(self.batch_tokens >= 1, f"test.batch_tokens must be >= 1, got {self.batch_tokens}")
        _check(self.audit_states >= 0, f"test.audit_states must be >= 0, got {self.audit_states}")


SHAPE_NAMES = ("qwen3_5-0.8b",)  # the shapes dohnuts.measure.shapes can build


@dataclass(frozen=True)
class BenchmarkConfig:
    """The latency protocol: cold call, warm-up calls, timed calls; `shape` names a model shape
    to benchmark with random weights instead of the checkpoint (records say shape-only); the
    varied-traffic workload times `varied_requests` requests of distinct layouts, the
    real-traffic workload `real_traffic_requests` (0: none) on first sight, and on CUDA the
    long-context workload one request of about each of `long_context` tokens. The serving
    workload runs `dohnuts serve` (`serving_workers` front ends) in processes of its own and
    drives it from `serving_client_processes` client processes with `serving_requests` distinct
    requests of the serving mix: open loop at each offered rate of `serving_rates` (requests/s),
    then closed loop at each count of `serving_clients`, each level `serving_seconds` long after
    `serving_warmup_seconds` of the same load; the clients run on the last `serving_client_cpus`
    CPUs and the server on the others (0: no pinning). `serving_requests: 0` leaves it out."""

    warmup: int = 3
    timed: int = 20
    shape: str | None = None
    varied_requests: int = 60
    real_traffic_requests: int = 80
    long_context: tuple[int, ...] = (8192, 32768, 65536)
    serving_requests: int = 512
    serving_rates: tuple[float, ...] = ()
    serving_clients: tuple[int, ...] = (1, 8, 64)
    serving_seconds: float = 30.0
    serving_warmup_seconds: float = 5.0
    serving_workers: int = 2
    serving_client_processes: int = 2
    serving_client_cpus: int = 0

    def __post_init__(self):
        _check(self.timed >= 2 and self.warmup >= 0,
               f"benchmark.timed must be >= 2 and warmup >= 0, got {self.timed}, {self.warmup}")
        _check(self.varied_requests >= 1, f"benchmark.varied_requests must be >= 1, got {self.varied_requests}")
        _check(self.real_traffic_requests >= 0 and all(tokens >= 64 for tokens in self.long_context),
               f"benchmark.real_traffic_requests must be >= 0 and long_context lengths >= 64, got "
               f"{self.real_traffic_requests}, {list(self.long_context)}")
        _check(self.serving_requests >= 0 and all(count >= 1 for count in self.serving_clients)
               and all(rate > 0 for rate in self.serving_rates),
               f"benchmark.serving_requests must be >= 0, serving_clients and serving_rates positive, got "
               f"{self.serving_requests}, {self.serving_clients}, {self.serving_rates}")
        _check(self.serving_seconds > 0 and self.serving_warmup_seconds >= 0 and self.serving_workers >= 1
               and self.serving_client_processes >= 1 and self.serving_client_cpus >= 0,
               f"benchmark.serving_seconds must be > 0, serving_warmup_seconds >= 0, serving_workers and "
               f"serving_client_processes >= 1 and serving_client_cpus >= 0, got {self.serving_seconds}, "
               f"{self.serving_warmup_seconds}, {self.serving_workers}, {self.serving_client_processes}, "
               f"{self.serving_client_cpus}")
        _check(self.shape is None or self.shape in SHAPE_NAMES,
               f"benchmark.shape must be null or one of {SHAPE_NAMES}, got {self.shape!r}")


@dataclass(frozen=True)
class DistributedConfig:
    """How many processes train, select, calibrate and test run on (torchrun, one per GPU)."""

    processes: int = 1

    def __post_init__(self):
        _check(self.processes >= 1, f"distributed.processes must be >= 1, got {self.processes}")


SECTIONS = {
    "model": ModelConfig, "lora": LoraConfig, "data": DataConfig, "train": TrainConfig,
    "select": SelectConfig, "calibrate": CalibrateConfig, "test": TestConfig,
    "benchmark": BenchmarkConfig, "distributed": DistributedConfig,
}
INIT_CHOICES = ("base", "checkpoint")


def build(cls, data, path: str):
    """Build dataclass `cls` from a mapping, rejecting unknown keys and ill-typed values."""
    if data is None:
        data = {}
    _check(isinstance(data, dict), f"{path} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    _check(not unknown, f"{path} has unknown keys {sorted(unknown)}; known: {sorted(names)}")
    values = {name: _typed(hints[name], value, f"{path}.{name}") for name, value in data.items()}
    try:
        return cls(**values)
    except TypeError as error:
        raise ConfigError(f"{path}: {error}") from None


def _typed(hint, value, path: str):
    """`value` checked (and, for numbers, converted) against a field's type hint."""
    if dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if typing.get_origin(hint) is tuple:
        item_type = typing.get_args(hint)[0]
        name = {str: "strings", int: "integers", float: "numbers"}[item_type]
        accepted = (int, float) if item_type is float else item_type  # a number may be written 20, not 20.0
        _check(isinstance(value, (list, tuple)) and all(isinstance(item, accepted) and not isinstance(item, bool)
                                                        for item in value),
               f"{path} must be a list of {name}, got {value!r}")
        return tuple(item_type(item) for item in value) if item_type is float else tuple(value)
    allowed = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        _check(type(None) in allowed, f"{path} must not be empty")
        return None
    if bool in allowed:
        _check(isinstance(value, bool), f"{path} must be true or false, got {value!r}")
    elif float in allowed:
        # YAML reads 1e-4 (no dot) as a string: say so rather than fail later.
        _check(isinstance(value, (int, float)) and not isinstance(value, bool),
               f"{path} must be a number, got {value!r} (write 1.0e-4, not 1e-4)")
        return float(value)
    elif int in allowed:
        _check(isinstance(value, int) and not isinstance(value, bool), f"{path} must be an integer, got {value!r}")
    elif str in allowed:
        _check(isinstance(value, str), f"{path} must be a string, got {value!r}")
    elif dict in allowed:
        _check(isinstance(value, dict), f"{path} must be a mapping, got {value!r}")
    return value


def section(params: dict, name: str):
    """Load one named section of a params mapping into its frozen dataclass."""
    return build(SECTIONS[name], params.get(name), name)


def init_mode(params: dict) -> str:
    """The `init` top-level param: start from the base or from a parent checkpoint."""
    value = params.get("init", "base")
    _check(value in INIT_CHOICES, f"init must be one of {INIT_CHOICES}, got {value!r}")
    return value


def to_dict(config) -> dict:
    """A JSON-ready dict of a config dataclass (tuples become lists)."""
    return json_ready(dataclasses.asdict(config))


def json_ready(value):
    if isinstance(value, dict):
        return {key: json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def read_params(path) -> dict:
    """The params mapping from a YAML file whose path the caller (a stage script) gives.

    Raises:
        ConfigError: not YAML, not UTF-8, or not a mapping.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            params = yaml.safe_load(handle) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path} is not UTF-8 text: {error}") from None
    _check(isinstance(params, dict), f"{path} must hold a mapping of sections, got {type(params).__name__}")
    return params
