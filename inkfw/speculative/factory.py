"""The engine factory: one function builds every :class:`~inkfw.speculative.engine.Engine`.

infer, bench, the training module's validation acceptance, the tests and the server all call
:func:`build_engine` with a composed serving config (``inkfw/conf/infer.yaml``, or
:func:`serving_config` with overrides) and, optionally, a model they already hold.

The config's serving keys:

* ``model``: a ``inkfw/conf/model`` node (random-init ``sizes`` or a checkpoint ``path``), used only
  when no model is given, and for its tokenizer;
* ``drafter`` / ``verifier`` / ``sampler`` / ``kv``: ``_partial_`` nodes of ``inkfw/conf/drafter``,
  ``inkfw/conf/verifier``, ``inkfw/conf/sampler`` and ``inkfw/conf/kv``; the factory adds what is only known at
  run time. The sampler gets ``device``; the drafter ``model``, ``num_tokens``, ``num_depths``
  and ``sampler``; the verifier ``model`` and ``sampler``; the KV manager ``model``,
  ``num_draft_depths``, ``lookahead``, ``num_draft_tokens``, ``max_model_len``,
  ``max_num_seqs`` and ``max_num_batched_tokens`` (each only the ones its signature names,
  unless it takes ``**kwargs``). Drafter and verifier share the one sampler, which the engine
  also uses for per-request generators;
* ``engine``: the ``inkfw/conf/engine`` node, instantiated as is
  (``_target_: inkfw.speculative.engine.EngineConfig``);
* ``kernels``: a ``_partial_`` node of ``inkfw/conf/kernels`` (``backend: auto | triton | torch``),
  given ``device``; the one :class:`~inkfw.kernels.Kernels` goes to the drafter, the verifier and
  the KV manager as ``kernels``;
* ``mtp.depths`` (D, null: all that ship), ``mtp.embed_source``, ``spec.num_tokens`` (k,
  null: D), ``device``, ``dtype``.

A group missing from the config falls back to its default (MTP drafting aside: no drafter).
Bad options raise :class:`~inkfw.errors.ConfigError` (one sentence) before any model is loaded.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig

from inkfw.checkpoint import read_tokenizer
from inkfw.cli_args import one_line
from inkfw.errors import ConfigError
from inkfw.kernels import Kernels, prepare_backend
from inkfw.nodes import build_node
from inkfw.paths import config_dir
from inkfw.presets import build_model, plain, resolve_path
from inkfw.speculative.engine import Engine, EngineConfig

SERVING_CONFIG = "infer"  # inkfw/conf/infer.yaml: the config scripts/infer.py composes
DEFAULT_NGRAM_TOKENS = 4  # k for drafter=ngram when neither spec.num_tokens nor any depth says otherwise
DRAFTER_NAMES = {"MtpDrafter": "mtp", "NgramDrafter": "ngram", "NoDrafter": "none"}


# ----------------------------------------------------------------------------- config
@contextmanager
def _own_global_hydra() -> Iterator[None]:
    """Compose beside a running ``@hydra.main`` app: park its global state, restore it after."""
    gh = GlobalHydra.instance()
    running = gh.hydra if gh.is_initialized() else None
    if running is not None:
        gh.clear()
    try:
        yield
    finally:
        if running is not None:
            GlobalHydra.instance().hydra = running


def serving_config(overrides: Sequence[str] | None = None) -> DictConfig:
    """``inkfw/conf/infer.yaml`` composed with Hydra-style ``overrides`` (e.g. ``["drafter=none",
    "engine.max_num_seqs=4"]``): the config the CLI builds its engine from. Works inside or
    outside a running Hydra app; a bad override raises :class:`ConfigError`."""
    overrides = [str(o) for o in overrides or []]
    try:
        with _own_global_hydra(), initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            return compose(SERVING_CONFIG, overrides=overrides)
    except HydraException as exc:
        detail = one_line(exc).rstrip(".")  # an unknown key: "unknown option 'x'; to add a new key write +x=1"
        raise ConfigError(f"cannot compose the serving config with {overrides} ({detail}).") from exc


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b`` or ``default`` when any part is missing or null."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def _int_option(name: str, value: Any, minimum: int, allow_null: bool = True, hint: str = "") -> int | None:
    if value is None and allow_null:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(
            f"{name} must be {'null or ' if allow_null else ''}an integer >= {minimum}{hint}, got {value!r}."
        )
    return value


def drafter_kind(drafter_node: Any) -> str:
    """``mtp`` / ``ngram`` / ``none`` for the stock drafters, else the target's class name."""
    target = str(_get(drafter_node, "_target_", "inkfw.speculative.drafters.NoDrafter"))
    cls = target.rsplit(".", 1)[-1]
    return DRAFTER_NAMES.get(cls, cls)


AUTO = "auto"  # spec.num_tokens=auto: adaptive k (inkfw.speculative.adaptive)


def adaptive_requested(cfg: Any) -> bool:
    """True for ``spec.num_tokens=auto``."""
    return _get(cfg, "spec.num_tokens") == AUTO


def engine_options(cfg: Any) -> tuple[str, int | None, int | None]:
    """(drafter kind, D requested, k requested), validated without building anything; with
    ``spec.num_tokens=auto`` k is the largest k adaptive k may choose (``spec.max_num_tokens``,
    null: D)."""
    kind = drafter_kind(cfg.get("drafter"))
    if adaptive_requested(cfg):
        depths = _int_option("mtp.depths", _get(cfg, "mtp.depths"), 1 if kind == "mtp" else 0)
        k_max = _int_option(
            "spec.max_num_tokens", _get(cfg, "spec.max_num_tokens"), 1, hint=" (the largest k of spec.num_tokens=auto)"
        )
        return kind, depths, k_max
    depths = _int_option(
        "mtp.depths",
        _get(cfg, "mtp.depths"),
        1 if kind == "mtp" else 0,
        hint=" (null: all depths the checkpoint ships)",
    )
    k = _int_option(
        "spec.num_tokens",
        _get(cfg, "spec.num_tokens"),
        1,
        hint=" or 'auto' (draft tokens per verify step; null: mtp.depths)",
    )
    return kind, depths, k


def engine_config(cfg: Any) -> EngineConfig:
    """The ``engine`` node instantiated (``inkfw/conf/engine``: its ``_target_`` is
    :class:`EngineConfig`) and validated; a node without ``_target_`` is taken as its fields."""
    node = cfg.get("engine") if hasattr(cfg, "get") else None
    if node is None:
        ec = EngineConfig()
    elif _get(node, "_target_") is not None:
        ec = build_node("engine", node)
    else:
        fields = plain(node)
        try:
            ec = EngineConfig(**fields)
        except TypeError as exc:
            raise ConfigError(f"engine: {exc}.") from exc
    if not isinstance(ec, EngineConfig):
        raise ConfigError(
            f"engine: _target_ must build an inkfw.speculative.engine.EngineConfig, got {type(ec).__name__}."
        )
    ec.validate()
    return ec


# ----------------------------------------------------------------------------- components
def _factory(cfg: Any, group: str, default: Callable) -> Callable:
    """The group's node as a callable that takes the runtime arguments (``_partial_`` nodes)."""
    node = cfg.get(group) if hasattr(cfg, "get") else None
    if node is None:
        return default
    return build_node(group, node, _partial_=True)


def _accepted(factory: Callable, runtime: dict[str, Any]) -> dict[str, Any]:
    """The runtime arguments ``factory`` takes (all of them if it takes ``**kwargs``), so a
    component need not accept what only other components use."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return runtime
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return runtime
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in runtime.items() if k in names}


def _call(group: str, factory: Callable, **runtime: Any) -> Any:
    """``factory(**runtime)``; an option the target does not take becomes a :class:`ConfigError`."""
    try:
        return factory(**_accepted(factory, runtime))
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc) or "missing" in str(exc) and "argument" in str(exc):
            raise ConfigError(f"{group}: {exc}.") from exc
        raise


def _default_sampler(**kwargs: Any):
    from inkfw.speculative.sampling import Sampler

    return Sampler(**kwargs)


def _default_drafter(**kwargs: Any):
    from inkfw.speculative.drafters import NoDrafter

    return NoDrafter(**kwargs)


def _default_verifier(**kwargs: Any):
    from inkfw.speculative.verifier import TargetVerifier

    return TargetVerifier(**kwargs)


def _default_kv(**kwargs: Any):
    from inkfw.cache.paged import PagedKVManager

    return PagedKVManager(**_accepted(PagedKVManager, kwargs))


def load_tokenizer(model_node: Any):
    """``tokenizers.Tokenizer`` from ``<model.path>/tokenizer.json``, or None (no path or no file)."""
    path = _get(model_node, "path")
    if not path:
        return None
    file = resolve_path(path) / "tokenizer.json"
    return read_tokenizer(file) if file.is_file() else None


def _model_source(model_node: Any) -> str:
    path = _get(model_node, "path")
    return str(resolve_path(path)) if path else f"preset {_get(model_node, 'name')!r}"


# ----------------------------------------------------------------------------- the factory
def build_engine(cfg: Any, model=None, tokenizer=None) -> tuple[Engine, Any]:
    """(engine, tokenizer or None) for the composed serving config ``cfg`` (module docstring).

    ``model``: a built model to serve as is (nothing is built or loaded); with ``drafter=mtp`` it
    must hold at least ``mtp.depths`` depths. ``tokenizer``: None reads
    ``<cfg.model.path>/tokenizer.json`` when there is one.
    """
    kind, depths, k = engine_options(cfg)
    ec = engine_config(cfg)  # fail on bad engine and kernel options before loading anything
    prepare_backend(_get(cfg, "kernels.backend", "auto"), _get(cfg, "device", "auto"))
    if model is None:
        # build (or read) only the depths the drafter uses; a random-init preset's backbone is
        # the same whatever number of depths is built
        model = build_model(
            cfg.model,
            mtp_depths=depths if kind == "mtp" else 0,
            dtype=_get(cfg, "dtype", "float32"),
            device=_get(cfg, "device", "auto"),
            embed_source=_get(cfg, "mtp.embed_source", "backbone_norm"),
        )
        if depths is not None:  # no more than ship, whichever drafter runs
            model.cfg.mtp_depths_to_build(depths, source=_model_source(cfg.model))
    if tokenizer is None and cfg.get("model") is not None:
        tokenizer = load_tokenizer(cfg.model)

    if kind == "mtp":
        built = model.num_mtp_depths
        if depths is not None and depths > built:
            raise ConfigError(f"mtp.depths={depths} but the model holds {built} MTP depth(s).")
        num_depths = depths if depths is not None else built
    else:
        num_depths = depths if depths is not None else model.cfg.mtp.num_nextn_predict_layers
    if k is None:
        k = num_depths if kind == "mtp" else (num_depths or DEFAULT_NGRAM_TOKENS)

    device = next(model.parameters()).device
    kernels = _call("kernels", _factory(cfg, "kernels", Kernels), device=device)
    if kernels.backend == "triton" and device.type != "cuda" and ec.compile:
        raise ConfigError(
            "kernels.backend=triton on the CPU runs Triton's interpreter, which torch.compile cannot "
            "trace: use engine.compile=false or kernels.backend=torch."
        )
    sampler = _call("sampler", _factory(cfg, "sampler", _default_sampler), device=device)
    drafter = _call(
        "drafter",
        _factory(cfg, "drafter", _default_drafter),
        model=model,
        num_tokens=k,
        num_depths=num_depths,
        sampler=sampler,
        kernels=kernels,
    )
    verifier = _call(
        "verifier", _factory(cfg, "verifier", _default_verifier), model=model, sampler=sampler, kernels=kernels
    )
    kv = _call(
        "kv",
        _factory(cfg, "kv", _default_kv),
        model=model,
        num_draft_depths=drafter.num_depths,
        lookahead=drafter.lookahead,
        num_draft_tokens=drafter.num_tokens,
        max_model_len=ec.max_model_len,
        max_num_seqs=ec.max_num_seqs,
        max_num_batched_tokens=ec.max_num_batched_tokens,
        kernels=kernels,
    )
    adaptive = None
    if adaptive_requested(cfg) and drafter.num_tokens > 0:
        from inkfw.speculative.adaptive import AdaptiveK

        adaptive = AdaptiveK(drafter.num_tokens, lookahead=drafter.lookahead)
    engine = Engine(model, drafter, verifier, kv, sampler=sampler, config=ec, tokenizer=tokenizer, adaptive=adaptive)
    return engine, tokenizer
