"""The experiment configuration: typed sections of fields, checked as they are set.

An :class:`ExperimentConfig` nests one section per concern (:class:`Data`,
:class:`Model`, :class:`Eval`, :class:`Workers`, :class:`Server`,
:class:`Worker`, :class:`Plan`, :class:`Stages`, :class:`Processes`), each a
dataclass whose fields are declared like the library's settings
(``hpsjax._config_flags``: a field's metadata ``help`` says what it is). A
value is checked against its field's type the moment it is set (a scheme's
``get_config``, ``--set=KEY=VALUE``, ``--config.KEY=VALUE``): an unknown field
or a value of the wrong type is one ``ValueError`` naming the field, the
closest field and the valid ones; a float field takes an int, a tuple field a
list. What the values mean together (registry names, local steps without a
local optimizer, ...) is checked once, by :func:`experiments.registry.check_config`;
:meth:`Section.freeze` then fixes the config for the run. The free-form keyword
arguments of a registry entry (``server.policy_kwargs``, ``model.args``, ...)
are :class:`Args`, a dict whose keys read as attributes. A field that is a
setting of the run configuration (:mod:`hpsjax.config`; ``worker.local_steps``
is ``WorkerConfig.local_steps``) names that setting (:func:`run_fields`), and
:func:`run_settings` gives the config's values of them, by the run's classes.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from hpsjax.ps import ServerOptions
from hpsjax.worker import WorkerCommand, WorkerConfig

__all__ = [
    "Args",
    "Data",
    "Eval",
    "ExperimentConfig",
    "Model",
    "Plan",
    "Processes",
    "RUN_CLASSES",
    "Section",
    "Server",
    "UnknownField",
    "Stages",
    "Worker",
    "Workers",
    "field_help",
    "field_names",
    "run_fields",
    "run_settings",
]


class UnknownField(ValueError):
    """A field name that the config or a section does not have."""


class Args(dict):
    """Keyword arguments of a registry entry: a dict whose keys read as
    attributes (``config.server.policy_kwargs.staleness_bound``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        del self[name]

    def to_dict(self) -> dict[str, Any]:
        """A plain ``dict`` of the arguments (nested ``Args`` too)."""
        return {k: v.to_dict() if isinstance(v, Args) else v for k, v in self.items()}


def _field(default: Any, help: str) -> Any:
    """A field of a section: its default and what it is."""
    if isinstance(default, dict):
        return dataclasses.field(
            default_factory=lambda: Args(default), metadata={"help": help}
        )
    if isinstance(default, type) and issubclass(default, Section):
        return dataclasses.field(default_factory=default, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


# The run configuration's classes (hpsjax.config) that a field may be.
RUN_CLASSES: dict[str, type] = {
    "ServerOptions": ServerOptions,
    "WorkerCommand": WorkerCommand,
    "WorkerConfig": WorkerConfig,
}


def _run_field(default: Any, help: str, run: str) -> Any:
    """A field that is a setting of the run configuration (:mod:`hpsjax.config`),
    ``run`` naming it (``"WorkerConfig.local_steps"``): the experiment's name
    and default for it, the setting's meaning and rule (:func:`run_settings`)."""
    owner, _, name = run.partition(".")
    if name not in {f.name for f in dataclasses.fields(RUN_CLASSES[owner])}:
        raise ValueError(f"{run} is no setting of the run configuration")
    field = _field(default, help)
    field.metadata = types.MappingProxyType({**field.metadata, "run": run})
    return field


class Section:
    """A group of typed fields: set values are checked, unknown names refused.

    Subclasses are dataclasses; ``PREFIX`` is the section's dotted path in the
    config (``"server."``), for the messages.
    """

    PREFIX: typing.ClassVar[str] = ""

    def __setattr__(self, name: str, value: Any) -> None:
        hints = _hints(type(self))
        if name not in hints:
            raise UnknownField(_unknown(self, name))
        if self.__dict__.get("_frozen"):
            raise ValueError(
                f"{self.PREFIX}{name}: the config is frozen once checked; "
                "change a copy (config.copy())"
            )
        object.__setattr__(self, name, _coerce(self.PREFIX + name, hints[name], value))

    # Item access by field name: dotted paths (--set) walk the sections.
    def __getitem__(self, name: str) -> Any:
        if name not in _hints(type(self)):
            raise KeyError(_unknown(self, name))
        return getattr(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self, name, value)

    def __contains__(self, name: object) -> bool:
        return name in _hints(type(self))

    def keys(self) -> list[str]:
        """The section's field names, in order."""
        return field_names(type(self))

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(name, value)`` of each field."""
        return ((name, getattr(self, name)) for name in self.keys())

    def freeze(self) -> None:
        """Refuses any change from now on (sections included)."""
        for _, value in self.items():
            if isinstance(value, Section):
                value.freeze()
        object.__setattr__(self, "_frozen", True)

    @property
    def frozen(self) -> bool:
        """Whether :meth:`freeze` fixed the values."""
        return bool(self.__dict__.get("_frozen"))

    def copy(self) -> Section:
        """A deep copy that may be changed (not frozen)."""
        clone = copy.deepcopy(self)
        _thaw(clone)
        return clone

    def to_dict(self) -> dict[str, Any]:
        """The values as plain dicts, lists and scalars (tuples as lists)."""
        return json.loads(self.to_json())

    def to_json(self, indent: int | None = None) -> str:
        """The values as JSON, sections as objects, in field order."""
        return json.dumps(_plain(self), indent=indent)

    # The name ml_collections gave it, which work directories' readers use.
    to_json_best_effort = to_json

    def matches(self, saved: Mapping[str, Any]) -> bool:
        """Whether ``saved`` (a ``config.json`` read back) holds these values.

        A field ``saved`` lacks (a work directory written before the field was
        declared) matches when it is at its default.
        """
        if set(saved) - set(self.keys()):
            return False
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name not in saved:
                if _plain(value) != _plain(_default(field)):
                    return False
            elif isinstance(value, Section):
                if not isinstance(saved[field.name], Mapping):
                    return False
                if not value.matches(saved[field.name]):
                    return False
            elif _plain(value) != saved[field.name]:
                return False
        return True


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _thaw(section: Section) -> None:
    section.__dict__.pop("_frozen", None)
    for _, value in section.items():
        if isinstance(value, Section):
            _thaw(value)


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return {name: _plain(v) for name, v in value.items()}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The fields' types of a section class, by name (cached)."""
    if cls not in _HINTS:
        names = {f.name for f in dataclasses.fields(cls)}
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {name: hints[name] for name in names}
    return _HINTS[cls]


def field_names(cls: type) -> list[str]:
    """The field names of a section class, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


def field_help(cls: type | None = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted name, type, help)`` of every field of the config (sections
    walked), from the fields' declarations: the ``--config.KEY`` flags."""
    cls = ExperimentConfig if cls is None else cls
    rows = []
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if isinstance(kind, type) and issubclass(kind, Section):
            rows += field_help(kind, f"{prefix}{field.name}.")
        else:
            rows.append((prefix + field.name, _describe(kind), field.metadata["help"]))
    return rows


def run_fields(cls: type | None = None, prefix: str = "") -> dict[str, str]:
    """The config's fields that are settings of the run configuration:
    dotted name -> setting (``{"worker.local_steps":
    "WorkerConfig.local_steps", ...}``), sections walked."""
    cls = ExperimentConfig if cls is None else cls
    found = {}
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if isinstance(kind, type) and issubclass(kind, Section):
            found.update(run_fields(kind, f"{prefix}{field.name}."))
        elif "run" in field.metadata:
            found[prefix + field.name] = field.metadata["run"]
    return found


def run_settings(config: ExperimentConfig) -> dict[str, dict[str, Any]]:
    """The run configuration's settings that ``config`` gives, by class:
    ``{"WorkerConfig": {"local_steps": 4, ...}, "WorkerCommand": {...},
    "ServerOptions": {...}}`` (an experiment's ``"none"`` overlap is the
    run's ``None``)."""
    settings: dict[str, dict[str, Any]] = {name: {} for name in RUN_CLASSES}
    for path, run in run_fields().items():
        owner, _, name = run.partition(".")
        value = config.get_path(path)
        if run == "WorkerConfig.overlap" and value == "none":
            value = None
        settings[owner][name] = _plain(value)
    return settings


def _unknown(section: Section, name: str) -> str:
    names = field_names(type(section))
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = ("config." + section.PREFIX).rstrip(".")
    return f"{where} has no field {name!r}; {hint}its fields: {', '.join(names)}"


def _describe(kind: Any) -> str:
    if isinstance(kind, type):
        return kind.__name__
    return str(kind).replace("typing.", "")


def _union(kind: Any) -> tuple[Any, ...] | None:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        return typing.get_args(kind)
    return None


def _coerce(name: str, kind: Any, value: Any) -> Any:
    """``value`` as a ``kind`` (an int for a float, a tuple for a list).

    Raises:
      ValueError: a value that is not of the field's type, naming the field.
    """
    options = _union(kind)
    if options is not None:
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(name, option, value)
            except ValueError:
                continue
    else:
        converted = _convert(kind, value)
        if converted is not _NO:
            return converted
    raise ValueError(f"{name} must be {_describe(kind)}, got {value!r}")


_NO = object()


def _convert(kind: Any, value: Any) -> Any:
    """``value`` as a ``kind``, or ``_NO`` if it is not one."""
    if kind is Any:
        return value
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok else _NO
    if kind in (int, bool, str):
        ok = type(value) is kind or (kind is int and isinstance(value, int)
                                     and not isinstance(value, bool))  # fmt: skip
        return value if ok else _NO
    origin = typing.get_origin(kind) or kind
    if isinstance(origin, type) and issubclass(origin, Section):
        if isinstance(value, origin):
            return value
        return origin(**value) if isinstance(value, Mapping) else _NO
    if origin is tuple:
        if not isinstance(value, tuple | list):
            return _NO
        args = typing.get_args(kind)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if item is None:
            return tuple(tuple(v) if isinstance(v, list) else v for v in value)
        converted = [_convert(item, v) for v in value]
        return _NO if _NO in converted else tuple(converted)
    if origin in (dict, Mapping):
        return Args(value) if isinstance(value, Mapping) else _NO
    return _NO


@dataclasses.dataclass(eq=True)
class Data(Section):
    """What the workers train on (``hpsjax.data``)."""

    PREFIX: typing.ClassVar[str] = "data."
    name: str = _run_field(
        "synthetic_digits",
        "a dataset of hpsjax.data, or 'npz'",
        "WorkerCommand.dataset",
    )
    num_examples: int = _field(6000, "examples generated (generated datasets)")
    image_size: int = _field(8, "side of a generated image")
    path: str = _field("", "the .npz file of name='npz'")
    x_key: str = _field("x", "the inputs' key in the .npz file")
    y_key: str = _field("y", "the labels' key in the .npz file")
    test_fraction: float = _run_field(
        0.2, "share of the examples held out", "WorkerCommand.test_fraction"
    )
    seed: int = _field(0, "seed of the generated examples (not of the run)")
    args: dict[str, Any] = _field({}, "further keyword arguments of the dataset")  # noqa: RUF009 (a default_factory)


@dataclasses.dataclass(eq=True)
class Model(Section):
    """The model (``hpsjax.models``, or a factory ``package.module:make``)."""

    PREFIX: typing.ClassVar[str] = "model."
    name: str = _field("mlp", "a model of hpsjax.models or package.module:make")
    hidden: tuple[int, ...] = _field((64, 64), "an MLP's hidden widths")
    seed: int = _run_field(
        0, "seed of the initial parameters", "WorkerCommand.model_seed"
    )
    args: dict[str, Any] = _field({}, "further keyword arguments of the model")  # noqa: RUF009 (a default_factory)


@dataclasses.dataclass(eq=True)
class Eval(Section):
    """Evaluation and the target a run is timed to (experiments/target.py)."""

    PREFIX: typing.ClassVar[str] = "eval."
    every_seconds: float = _run_field(
        0.5, "seconds between two evaluations", "WorkerCommand.eval_every"
    )
    target_metric: str | None = _run_field(
        None, "the target's metric (None: the task's)", "WorkerCommand.target_metric"
    )
    target_value: float | None = _run_field(
        None, "the target's value", "WorkerCommand.target_value"
    )
    target_accuracy: float | None = _field(None, "an accuracy target's value")
    batch_size: int = _run_field(
        2048, "examples per evaluation batch", "WorkerCommand.eval_batch_size"
    )


@dataclasses.dataclass(eq=True)
class Workers(Section):
    """The workers' speeds, links and devices (injected heterogeneity)."""

    PREFIX: typing.ClassVar[str] = "workers."
    slowdowns: tuple[float, ...] = _field((1.0,), "each worker's slowdown")
    step_time: float = _field(0.05, "simulator: seconds per step at slowdown 1")
    step_overhead: float = _field(0.01, "simulator: the part not growing with batch")
    jitter: float = _field(0.1, "spread of a mean-one lognormal step jitter")
    straggle_probability: float = _field(0.0, "chance that a step straggles")
    straggle_slowdown: float = _field(4.0, "slowdown of a straggling step")
    bandwidth: float | None = _field(None, "bytes per second of a link (None: none)")
    latency: float = _field(0.0, "seconds of latency per message")
    speed_changes: tuple[tuple, ...] = _field(
        (), "(worker, seconds, factor): from then on that worker's slowdown x factor"
    )
    devices: tuple[str, ...] = _field((), "processes: gpu:INDEX or cpu:CORES each")
    startup_times: tuple[float, ...] = _field(
        (), "simulator: extra seconds of each worker's first round"
    )


@dataclasses.dataclass(eq=True)
class Server(Section):
    """The server: its policy, optimizer and deadlines."""

    PREFIX: typing.ClassVar[str] = "server."
    policy: str = _run_field(
        "bsp", "the server's policy (hpsjax.ps.POLICIES)", "ServerOptions.policy"
    )
    policy_kwargs: dict[str, Any] = _field({}, "the policy's keyword arguments")  # noqa: RUF009 (a default_factory)
    optimizer: str = _field("sgd", "the server's optimizer (experiments.registry)")
    learning_rate: float = _run_field(
        0.1, "the server's step size", "ServerOptions.learning_rate"
    )
    momentum: float = _run_field(
        0.0, "the server optimizer's momentum", "ServerOptions.momentum"
    )
    staleness_lr: str | None = _field(None, "scale_by_staleness policy, or None")
    dc_lambda: float | None = _field(None, "delay compensation's lambda, or None")
    dc_adaptive: bool = _field(False, "adaptive delay compensation")
    outer_delay: int | None = _field(None, "delayed_nesterov's N (None: workers)")
    deadline_factor: float = _field(10.0, "rounds before a silent worker is dropped")
    service_time: float = _field(0.0, "simulator: server seconds per push")
    cores: int = _field(0, "processes: CPU cores the server is pinned to (0: none)")
    optimizer_args: dict[str, Any] = _field({}, "the optimizer's keyword arguments")  # noqa: RUF009 (a default_factory)
    clip_norm: float | None = _field(None, "global-norm clipping ahead of it, or None")


@dataclasses.dataclass(eq=True)
class Worker(Section):
    """What each worker computes and pushes."""

    PREFIX: typing.ClassVar[str] = "worker."
    local_optimizer: str = _field("none", "'none' (gradients) or a local optimizer")
    local_learning_rate: float = _run_field(
        0.1, "the local optimizer's step size", "WorkerCommand.local_learning_rate"
    )
    local_momentum: float = _field(0.0, "the local optimizer's momentum")
    local_steps: int = _run_field(
        1, "local steps per round", "WorkerConfig.local_steps"
    )
    bits: int | None = _run_field(
        None, "push quantization bits, or None", "WorkerConfig.bits"
    )
    error_feedback: bool = _run_field(
        True, "error feedback of compressed pushes", "WorkerConfig.error_feedback"
    )
    compression: str = _field("none", "push compressor (registry.COMPRESSIONS)")
    compress_ratio: float = _field(0.01, "top_k/sparseloco share of values kept")
    powersgd_rank: int = _field(4, "power_sgd's rank")
    overlap: str = _run_field(
        "none", "overlap of communication (registry.OVERLAPS)", "WorkerConfig.overlap"
    )
    eager_pulls: int = _run_field(
        1, "pulls ahead of a round (PS+)", "WorkerConfig.eager_pulls"
    )
    staleness_lr: str | None = _run_field(
        None, "PS+: worker-side staleness scaling", "WorkerConfig.staleness_lr"
    )
    local_optimizer_args: dict[str, Any] = _field(  # noqa: RUF009 (a default_factory)
        {}, "the local optimizer's keyword arguments"
    )
    sparseloco_bits: int = _field(2, "sparseloco: bits per kept value")
    sparseloco_decay: float = _field(0.95, "sparseloco: error feedback's decay")
    sparseloco_chunk: int = _field(64, "sparseloco: the chunks' side (templar: 64)")
    streaming_fragments: int = _field(1, "streaming: fragments of the parameters")
    streaming_layout: str = _field("contiguous", "streaming: strided or contiguous")
    streaming_bits: int | str | None = _field(None, "streaming: bits, 'e2m1' or None")
    demo_decay: float = _field(0.999, "demo: momentum decay")
    demo_topk: int = _field(32, "demo: DCT coefficients kept per chunk")
    demo_chunk: int = _field(64, "demo: rows per chunk")


@dataclasses.dataclass(eq=True)
class Plan(Section):
    """Work plans: per-worker batches and local steps (hpsjax.planning)."""

    PREFIX: typing.ClassVar[str] = "plan."
    scheme: str = _field("none", "the plan's scheme (registry.PLAN_SCHEMES)")
    lr_scaling: str = _field("none", "step-size scale of a planned batch")
    local_steps: int = _field(1, "planned local steps")
    max_local_steps: int = _field(64, "most local steps a plan gives")
    replan: bool = _field(False, "re-plan as measured speeds drift")
    pilot: bool = _field(False, "processes: plan from the run's first rounds")
    pilot_tolerance: float = _run_field(
        0.05, "the pilot's relative standard error", "ServerOptions.pilot_tolerance"
    )
    pilot_rounds: int = _field(60, "the pilot's most rounds of a worker")
    pilot_grid: int = _field(
        4, "the pilot's batches on a grid of this many sizes a doubling (0: any)"
    )
    pilot_balance: int = _field(
        0, "rounds between the pilot's balancing checks after its fit (0: none)"
    )
    replan_threshold: float = _run_field(
        0.2, "drift that re-plans", "ServerOptions.replan_threshold"
    )
    replan_cooldown: float = _run_field(
        5.0, "seconds between two re-plans", "ServerOptions.replan_cooldown"
    )
    replan_window: int = _run_field(
        10, "rounds a re-plan looks back on", "ServerOptions.replan_window"
    )
    profile_batch_sizes: tuple[int, ...] = _field((16, 48), "batches profiled")
    profile_repeats: int = _run_field(
        2, "timed steps per profiled batch", "WorkerCommand.profile_repeats"
    )
    compress_ratio: float = _field(1.0, "ashl_reference: SHL top-k ratio")
    overlap_link_share: float | None = _field(
        None, "link share of a round above which the plan pipelines, or None"
    )


@dataclasses.dataclass(eq=True)
class Stages(Section):
    """ASHL's stages: AHL (async, many local steps), then SHL."""

    PREFIX: typing.ClassVar[str] = "stages."
    enabled: bool = _field(False, "run in stages")
    switch: str = _field("version", "the rule to leave AHL (registry.STAGE_SWITCHES)")
    switch_version: int = _field(100, "switch='version': the version")
    plateau_window: int = _field(20, "switch='plateau': rounds looked at")
    plateau_threshold: float = _field(0.01, "switch='plateau': relative change")
    switch_loss: float = _field(0.3, "switch='loss': the server's training loss")
    ahl_local_steps: int = _field(8, "AHL's local steps")
    ahl_max_staleness: int = _field(32, "AHL's staleness bound")
    shl_local_steps: int = _field(2, "SHL's local steps")
    shl_max_staleness: int = _field(4, "SHL's staleness bound")
    compress_from_stage: int | None = _run_field(
        None,
        "top-k pushes from this stage on, or None",
        "WorkerConfig.compress_from_stage",
    )


@dataclasses.dataclass(eq=True)
class Processes(Section):
    """Real processes: start and stop limits, the warm-up."""

    PREFIX: typing.ClassVar[str] = "processes."
    start_timeout: float = _field(300.0, "seconds the processes may take to start")
    shutdown_timeout: float = _field(30.0, "seconds they may take to stop")
    warmup: bool = _field(True, "two rounds first, so the timed run is compiled")


@dataclasses.dataclass(eq=True)
class ExperimentConfig(Section):
    """One experiment: a scheme in a setting, on a backend.

    Examples:
      >>> config = ExperimentConfig(budget_seconds=8)
      >>> config.budget_seconds, config.server.policy
      (8.0, 'bsp')
      >>> config.server.learning_rat = 0.2  # an UnknownField, a ValueError
      Traceback (most recent call last):
      ...
      experiments.configs.schema.UnknownField: config.server has no field \
'learning_rat'; did you mean \
'learning_rate'? its fields: ...
      >>> config.worker.bits = "8"
      Traceback (most recent call last):
      ...
      ValueError: worker.bits must be int | None, got '8'
    """

    scheme: str = _field("", "the scheme (experiments/configs/<scheme>.py)")
    setting: str = _field("sim8", "the setting (experiments.configs.common.SETTINGS)")
    backend: str = _field("sim", "'sim' (simulator) or 'processes' (real ones)")
    task: str = _run_field(
        "classification", "what is learned (hpsjax.tasks)", "WorkerCommand.task"
    )
    seed: int = _field(0, "the run's seed")
    budget_seconds: float = _field(60.0, "virtual or wall seconds of the run")
    max_updates: int | None = _field(None, "end after this many versions, or None")
    batch_size: int = _run_field(
        32, "samples per local step of each worker", "WorkerConfig.batch_size"
    )
    data: Data = _field(Data, "the data")  # noqa: RUF009 (a default_factory)
    model: Model = _field(Model, "the model")  # noqa: RUF009 (a default_factory)
    eval: Eval = _field(Eval, "evaluation and target")  # noqa: RUF009 (a default_factory)
    workers: Workers = _field(Workers, "the workers' heterogeneity")  # noqa: RUF009 (a default_factory)
    server: Server = _field(Server, "the server")  # noqa: RUF009 (a default_factory)
    worker: Worker = _field(Worker, "each worker")  # noqa: RUF009 (a default_factory)
    plan: Plan = _field(Plan, "work plans")  # noqa: RUF009 (a default_factory)
    stages: Stages = _field(Stages, "stages")  # noqa: RUF009 (a default_factory)
    processes: Processes = _field(Processes, "real processes")  # noqa: RUF009 (a default_factory)

    def set_path(self, path: str, value: Any) -> None:
        """Sets the dotted field ``path`` (``"server.learning_rate"``) to
        ``value``, keys of a free-form mapping included
        (``"server.policy_kwargs.staleness_bound"``).

        Raises:
          ValueError: no such field, or a value of the wrong type.
        """
        *parents, leaf = path.split(".")
        node: Any = self
        for i, key in enumerate(parents):
            if isinstance(node, Args):
                node = node.setdefault(key, Args())
            elif isinstance(node, Section) and key in node:
                node = node[key]
            elif isinstance(node, Section):
                raise UnknownField(_unknown(node, key))
            else:
                where = ".".join(["config", *parents[:i]])
                raise UnknownField(
                    f"{where} is a {type(node).__name__}, not a group of fields"
                )
        if not isinstance(node, Section | Args):
            where = ".".join(["config", *parents])
            raise UnknownField(
                f"{where} is a {type(node).__name__}, not a group of fields"
            )
        node[leaf] = value

    def get_path(self, path: str) -> Any:
        """The value of the dotted field ``path``.

        Raises:
          ValueError: no such field.
        """
        node: Any = self
        for key in path.split("."):
            if isinstance(node, Section):
                if key not in node:
                    raise UnknownField(_unknown(node, key))
                node = node[key]
            elif isinstance(node, Mapping) and key in node:
                node = node[key]
            else:
                raise UnknownField(f"the config has no field {path!r}")
        return node
