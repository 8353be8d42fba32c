"""Build a ready :class:`~inkfw.speculative.engine.Engine` from a composed Hydra config.

The config is the one ``conf/infer.yaml`` composes; only ``model`` is required, everything
else falls back to the defaults of the conf files:

* ``model``: a ``conf/model`` node (random-init ``sizes`` or a checkpoint ``path``);
* ``drafter`` / ``sampler`` / ``kv``: ``_partial_`` nodes of ``conf/drafter``, ``conf/sampler``
  and ``conf/kv``; the builder adds what is only known at run time. Every drafter is called
  with ``model``, ``num_tokens``, ``num_depths`` and ``sampler`` (taking what it needs), the
  KV manager with ``model``, ``num_draft_depths``, ``lookahead``, ``num_draft_tokens``,
  ``max_model_len``, ``max_num_seqs`` and ``max_num_batched_tokens``, the sampler with
  ``device`` (each only with the ones its signature names, unless it takes ``**kwargs``);
* ``mtp.depths`` (D, null: all that ship), ``mtp.embed_source``, ``spec.num_tokens`` (k,
  null: D), ``engine.*`` (:class:`EngineConfig` fields), ``device``, ``dtype``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from inkfw.checkpoint import read_tokenizer
from inkfw.errors import ConfigError, InkfwError
from inkfw.presets import build_model, resolve_path
from inkfw.speculative.engine import Engine, EngineConfig
from inkfw.speculative.sampling import Sampler
from inkfw.speculative.verifier import TargetVerifier

DEFAULT_NGRAM_TOKENS = 4  # k for drafter=ngram when neither spec.num_tokens nor any depth says otherwise

DRAFTER_NAMES = {"MtpDrafter": "mtp", "NgramDrafter": "ngram", "NoDrafter": "none"}


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
        raise ConfigError(f"{name} must be {'null or ' if allow_null else ''}an integer >= {minimum}{hint}, "
                          f"got {value!r}.")
    return value


def drafter_kind(drafter_node: Any) -> str:
    """``mtp`` / ``ngram`` / ``none`` for the stock drafters, else the target's class name."""
    target = str(_get(drafter_node, "_target_", "inkfw.speculative.drafters.NoDrafter"))
    cls = target.rsplit(".", 1)[-1]
    return DRAFTER_NAMES.get(cls, cls)


def _factory(cfg: Any, group: str, default: Callable) -> Callable:
    """The group's node as a callable that takes the runtime arguments (``_partial_`` nodes)."""
    node = cfg.get(group) if hasattr(cfg, "get") else None
    if node is None:
        return default
    try:
        made = instantiate(node, _partial_=True)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, InkfwError):
            raise cause from None
        raise ConfigError(f"{group}: cannot build {_get(node, '_target_')!r} "
                          f"({str(exc).splitlines()[-1].strip()}).") from exc
    return made


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


def load_tokenizer(model_node: Any):
    """``tokenizers.Tokenizer`` from ``<model.path>/tokenizer.json``, or None (no path or no file)."""
    path = _get(model_node, "path")
    if not path:
        return None
    file = resolve_path(path) / "tokenizer.json"
    return read_tokenizer(file) if file.is_file() else None


def engine_options(cfg: Any) -> tuple[str, int | None, int | None]:
    """(drafter kind, D requested, k requested), validated without building anything."""
    kind = drafter_kind(cfg.get("drafter"))
    depths = _int_option("mtp.depths", _get(cfg, "mtp.depths"), 1 if kind == "mtp" else 0,
                         hint=" (null: all depths the checkpoint ships)")
    k = _int_option("spec.num_tokens", _get(cfg, "spec.num_tokens"), 1,
                    hint=" (draft tokens per verify step; null: mtp.depths)")
    return kind, depths, k


def engine_config(cfg: Any) -> EngineConfig:
    node = cfg.get("engine") if hasattr(cfg, "get") else None
    defaults = EngineConfig()
    ec = EngineConfig(
        max_num_seqs=_get(node, "max_num_seqs", defaults.max_num_seqs),
        max_num_batched_tokens=_get(node, "max_num_batched_tokens", defaults.max_num_batched_tokens),
        max_model_len=_int_option("engine.max_model_len", _get(node, "max_model_len"), 2,
                                  hint=" (null: the model's max_position_embeddings)"),
        check_drafts=bool(_get(node, "check_drafts", False)),
    )
    ec.validate()
    return ec


def build_engine(cfg: Any) -> tuple[Engine, Any]:
    """(engine, tokenizer or None) for the composed config ``cfg`` (see the module docstring)."""
    kind, depths, _ = engine_options(cfg)
    engine_config(cfg)  # fail on bad engine options before loading anything
    # build (or read) only the depths the drafter uses; a random-init preset's backbone is
    # the same whatever number of depths is built
    mtp_depths = depths if kind == "mtp" else 0
    model = build_model(cfg.model, mtp_depths=mtp_depths, dtype=_get(cfg, "dtype", "float32"),
                        device=_get(cfg, "device", "auto"), embed_source=_get(cfg, "mtp.embed_source", "backbone_norm"))
    if depths is not None:  # no more than ship, whichever drafter runs
        model.cfg.mtp_depths_to_build(depths, source=_model_source(cfg.model))
    tokenizer = load_tokenizer(cfg.model)
    return engine_from_model(cfg, model, tokenizer), tokenizer


def _model_source(model_node: Any) -> str:
    path = _get(model_node, "path")
    return str(resolve_path(path)) if path else f"preset {_get(model_node, 'name')!r}"


def engine_from_model(cfg: Any, model, tokenizer=None) -> Engine:
    """An engine around an already built ``model`` (drafter, sampler and KV from ``cfg``).

    With ``drafter=mtp`` the model must hold at least ``mtp.depths`` depths.
    """
    kind, depths, k = engine_options(cfg)
    ec = engine_config(cfg)
    device = next(model.parameters()).device
    sampler = _call("sampler", _factory(cfg, "sampler", Sampler), device=device)
    if kind == "mtp":
        built = model.num_mtp_depths
        if depths is not None and depths > built:
            raise ConfigError(f"mtp.depths={depths} but the model holds {built} MTP depth(s).")
        num_depths = depths if depths is not None else built
    else:
        num_depths = depths if depths is not None else model.cfg.mtp.num_nextn_predict_layers
    if k is None:
        k = num_depths if kind == "mtp" else (num_depths or DEFAULT_NGRAM_TOKENS)
    drafter = _call("drafter", _factory(cfg, "drafter", _no_drafter), model=model, num_tokens=k,
                    num_depths=num_depths, sampler=sampler)
    kv = _call("kv", _factory(cfg, "kv", _paged_kv), model=model, num_draft_depths=drafter.num_depths,
               lookahead=drafter.lookahead, num_draft_tokens=drafter.num_tokens, max_model_len=ec.max_model_len,
               max_num_seqs=ec.max_num_seqs, max_num_batched_tokens=ec.max_num_batched_tokens)
    return Engine(model, drafter, TargetVerifier(), kv, sampler=sampler, config=ec, tokenizer=tokenizer)


def _no_drafter(**kwargs: Any):
    from inkfw.speculative.drafters import NoDrafter

    return NoDrafter(**kwargs)


def _paged_kv(**kwargs: Any):
    from inkfw.cache.paged import PagedKVManager

    return PagedKVManager(**_accepted(PagedKVManager, kwargs))
