"""The ``pbrl`` command line (typer).

Imports that cost seconds (torch, transformers, Prefect, matplotlib) happen inside the commands that need them,
each saying why, so that ``pbrl --help``, ``pbrl status`` and ``pbrl validate``'s config errors answer at once.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from pbrl.config import ConfigNotice, JobConfig, is_centralized, load_job, num_rounds
from pbrl.data.storage import STAGES, RunPaths, existing_rounds, read_manifest, read_states, trainer_stages
from pbrl.distributed.shards import require_ray_extra
from pbrl.errors import ConfigError, expected_error
from pbrl.run import progress

app = typer.Typer(
    help="pbrl: train cooperating LLM agents from preferences between their joint responses.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Packaged models (converted once under storage/models/).", no_args_is_help=True)
app.add_typer(models_app, name="models")
console = Console()
err = Console(stderr=True, soft_wrap=True)

SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a config option: key=value (repeatable).")]


# Exit codes: 2 = the input is wrong and nothing ran (config, options, run folder); 1 = a run failed;
# 130 = stopped by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED = 130


def _fail(exc: Exception, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(str(exc))}")
    return typer.Exit(code)


@contextmanager
def _expected_errors(code: int) -> Iterator[None]:
    """Every expected error (``pbrl.errors.EXPECTED_ERRORS``, also when Prefect re-raised or wrapped it)
    becomes one ``error:`` line and exit ``code``; anything else is a bug and keeps its traceback."""
    try:
        yield
    except Exception as exc:
        found = expected_error(exc)
        if found is None:
            raise
        raise _fail(found, code) from None


def _stopped(hint: str) -> typer.Exit:
    err.print(f"stopped; {escape(hint)}")
    return typer.Exit(INTERRUPTED)


def _load(config: Path, overrides: list[str] | None, run_name: str | None = None, *, quiet: bool = False) -> JobConfig:
    extra = [*(overrides or [])]
    if run_name:
        extra.append(f"run_name={run_name}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigNotice)
        job = load_job(config, extra)
    for notice in caught:  # options that change nothing here, said once as a plain line (not at all when quiet)
        if issubclass(notice.category, ConfigNotice):
            if not quiet:
                err.print(f"[yellow]warning:[/] {escape(str(notice.message))}")
        else:
            warnings.warn_explicit(notice.message, notice.category, notice.filename, notice.lineno)
    if not job.run_name:
        job = job.model_copy(update={"run_name": config.stem})
    return job


@app.command()
def validate(config: Path, set_: SetOption = None) -> None:
    """Check a config file: prints OK, or every problem at once (exit code 2).

    Example: pbrl validate flows/configs/tiny-madpo-iter.yaml --set dpo_beta=0.2
    """
    from pbrl.run.preflight import preflight  # deferred: imports torch and transformers (seconds)

    with _expected_errors(2):
        job = _load(config, set_)
        preflight(job, prepare_models=False)  # task, import paths, datasets and models exist
    agents = f"{job.num_agents} roles, one actor" if is_centralized(job) else f"{job.num_agents} agents"
    console.print(f"OK: {config} ({job.trainer}, {agents})")


WideOption = Annotated[
    bool, typer.Option("--wide", help="Every column of the round table (default: the ones that fit 80 columns).")
]


def _print_wide_enough(table: Table, fit: bool) -> None:
    """Print ``table`` on stdout. ``fit``: in a terminal, at its width (an interval wraps at its spaces, no number
    is cut); else, and in logs and pipes (Rich's default is 80 columns), at the table's full width."""
    needed = console.measure(table, options=console.options.update_width(10_000)).maximum
    out = console if (fit and console.is_terminal) or needed <= console.width else Console(width=needed)
    out.print(table)


def _print_rounds(run_dir: Path, *, wide: bool = False, every_metric: bool = False) -> None:
    """The round table (compact, or ``wide``), with ``every_metric`` every metric of every round too; then
    ``report.png``."""
    from pbrl.reporting.metrics import round_table, write_run_metrics  # deferred: pandas and pyarrow
    from pbrl.reporting.report import write_report_png  # deferred: matplotlib
    from pbrl.reporting.table import all_metrics_rich, round_table_rich, trainer_of  # deferred: pandas

    write_run_metrics(run_dir)  # rebuilt from the manifests: also right for an interrupted run
    table = round_table(run_dir)
    wide = wide or every_metric
    shown = round_table_rich(table, trainer_of(run_dir), title=f"{run_dir.name}: rounds", wide=wide)
    _print_wide_enough(shown, fit=not wide)
    if every_metric:
        _print_wide_enough(all_metrics_rich(run_dir), fit=False)
    console.print(f"report: {write_report_png(run_dir, table)}")


def _runner_set(runner: str | None) -> list[str]:
    """``--runner X`` as the override ``runner=X`` (validated with every other option); another runner than ray
    also clears ``ray_address``, which only ray reads."""
    if runner is None:
        return []
    return [f"runner={runner}"] + ([] if runner == "ray" else ["ray_address="])


class RunDisplay:
    """What ``pbrl train`` shows while a run goes on, from its events (:mod:`pbrl.run.progress`), on ``out``
    (stderr): one line when a stage starts and one when it ends (:func:`~pbrl.run.progress.describe`: counts,
    seconds), the stage's messages as ``note:`` lines after it, and one line per round with its eval reward and
    paired gain.

    With ``bar`` (a terminal) the current stage also has a progress bar with its units, elapsed time and ETA, and
    the last logged step's metrics; without (a log file, a pipe) a progress line with its ETA is printed at most
    every ``every`` seconds of a stage. ``verbose`` adds a line per logged training step; ``quiet`` shows
    nothing. ``clock`` is the monotonic clock (seconds), replaceable in tests.
    """

    def __init__(
        self,
        out: Console,
        verbosity: str = "normal",
        bar: Progress | None = None,
        every: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out, self.verbosity, self.bar, self.every, self.clock = out, verbosity, bar, every, clock
        self.task = bar.add_task("starting", total=None, units="", latest="") if bar is not None else None
        self.started = self.last_line = clock()

    def __call__(self, event: progress.Event) -> None:
        if self.verbosity == "quiet":
            return
        if event.kind == "stage_start":
            self.started = self.last_line = self.clock()
            if self.bar is not None:
                where = f"round {event.round} {event.stage}"
                self.bar.reset(self.task, total=None, description=where, units="", latest="")
        elif event.kind == "progress":
            self._progress(event)
            return
        elif event.kind == "log":
            if self.bar is not None:
                latest = "  ".join(f"{k.rsplit('/', 1)[-1]} {v:.3g}" for k, v in list(event.metrics.items())[:3])
                self.bar.update(self.task, latest=latest)
            if self.verbosity != "verbose":
                return
        if event.kind == "run_end" and event.state != "Completed":
            return  # the command itself says how the run ended: an `error:` line, or `stopped; resume with …`
        line = progress.describe(event)
        if line is not None:
            self._line(line, style="red" if event.state == "Failed" else None)
        if event.kind == "stage_end":
            for message in event.messages:
                self._line(f"note: round {event.round} {event.stage}: {message}", style="yellow")

    def _progress(self, event: progress.Event) -> None:
        done, total = event.done or 0, event.total
        if self.bar is not None:
            self.bar.update(self.task, total=total, completed=done, units=f"{done}/{total or '?'} {event.unit}")
            return
        now = self.clock()
        if now - self.last_line < self.every or (total is not None and done >= total):
            return  # the end line follows at once
        self.last_line = now
        line = progress.describe(event) or ""
        if total and done:
            left = (now - self.started) / done * (total - done)
            line += f" (about {_duration(left)} left)"
        self._line(line)

    def _line(self, text: str, style: str | None = None) -> None:
        stamp = datetime.now().strftime("%H:%M:%S")
        self.out.print(Text(f"{stamp} {text}", style=style or ""), soft_wrap=True, highlight=False)


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min``, ``1.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _train_with_progress(job: JobConfig, resume: bool, verbosity: str) -> dict[str, Any]:
    """Run the training flow under :class:`RunDisplay`; log lines print through the same console, above the bar
    (:func:`pbrl.orchestration.console_logging`)."""

    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    show_bar = err.is_terminal and verbosity != "quiet"
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[units]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[latest]}"),
        console=err,
        transient=True,
        disable=not show_bar,
    )
    # report_to's trackers are attached by the training flow itself (flows/training.py), for every front end.
    with orchestration.console_logging(err, verbosity), bar:  # type: ignore[arg-type]
        unsubscribe = progress.subscribe(RunDisplay(err, verbosity, bar if show_bar else None))
        try:
            return orchestration.train(job, resume=resume)
        finally:
            unsubscribe()


@app.command()
def train(
    config: Annotated[Path | None, typer.Argument(help="YAML config (flat: run and trainer options).")] = None,
    set_: SetOption = None,
    run_name: Annotated[
        str | None, typer.Option(help="Run folder name (default: the config's run_name, else its file name).")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue an existing run from its last complete stage.")] = False,
    run: Annotated[Path | None, typer.Option(help="Resume this run folder (with --resume, instead of CONFIG).")] = None,
    runner: Annotated[
        str | None,
        typer.Option(
            help="Where item-parallel stages run: local or ray (the config's runner option; same artifacts either way)."
        ),
    ] = None,
    wide: WideOption = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Errors and the final round table only.")] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Also Prefect's own log lines and every logged training step.")
    ] = False,
) -> None:
    """Train a run (MADPO or MARLHF, base or iterative) through the Prefect flows: a line when each stage starts
    and ends, a progress bar inside the long ones (in a terminal), then the round table and report.png.

    Example: pbrl train flows/configs/tiny-madpo-iter.yaml --set num_iterations=3 --run-name try-1
    """
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first
    from pbrl.run.folder import open_run, run_dir_for, start_problems  # deferred: imports torch (seconds)
    from pbrl.run.preflight import preflight  # deferred: imports torch and transformers (seconds)

    if run is not None and not resume:
        raise _fail(ValueError("--run continues an existing run: add --resume"))
    if run is None and config is None:
        raise _fail(ValueError("give a CONFIG file, or --run RUN --resume"))
    if quiet and verbose:
        raise _fail(ValueError("--quiet and --verbose: give one of them"))
    verbosity = "quiet" if quiet else "verbose" if verbose else "normal"
    orchestration.quiet_libraries()  # before preflight, which may build or convert a packaged model
    folder: Path | None = run
    try:
        with _expected_errors(2):
            if run is not None:  # the stored job; --set and --runner may change what a resume may change
                job = open_run(run, [*(set_ or []), *_runner_set(runner)])
            else:
                job = _load(config, [*(set_ or []), *_runner_set(runner)], run_name, quiet=quiet)
            folder = run if run is not None else run_dir_for(job)
            problems = start_problems(job, folder, resume=resume)  # before Prefect starts: one clear message
            if problems:
                raise ConfigError(problems)
            if resume and not (folder / "run.json").is_file() and not quiet:
                err.print(f"note: no run at {folder} yet: starting it")
            # A resumed run reads its stored items; a new one's items are loaded and formatted here.
            stored = folder / "items.parquet"
            preflight(job, check_items=not (resume and stored.is_file()))
            require_ray_extra(job.runner)
        orchestration.mark_interrupts()
        with _expected_errors(1):
            out = _train_with_progress(job, resume, verbosity)
    except BaseException as exc:
        if isinstance(exc, typer.Exit) or not orchestration.interrupted(exc):
            raise
        # Ctrl-C: Prefect has recorded the run as crashed; finished stages are kept and come back cached.
        if folder is not None and (folder / "run.json").is_file():
            raise _stopped(f"resume with `pbrl train --run {folder} --resume`") from None
        raise _stopped("nothing was stored; start the run again") from None
    # The stages' messages were said as each stage ended (RunDisplay).
    with _expected_errors(1):
        _print_rounds(Path(out["run_dir"]), wide=wide)


@app.command()
def stage(
    name: Annotated[str, typer.Argument(help="Stage name, e.g. score-with-oracle.")],
    run: Annotated[Path, typer.Option(help="Run folder.")],
    round_: Annotated[int, typer.Option("--round", help="Round number (0 = baseline evaluation).")],
    force: Annotated[bool, typer.Option(help="Recompute even when cached.")] = False,
    no_prefect: Annotated[
        bool, typer.Option(help="Run the plain stage function (no cache, no retries, no UI).")
    ] = False,
) -> None:
    """Rerun one stage of a run as a one-task flow; later stages notice changed inputs on the next resume.

    Example: pbrl stage score-with-oracle --run storage/runs/tiny-madpo-iter --round 1
    """
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    orchestration.quiet_libraries()  # before the stages import transformers
    from pbrl.run.folder import open_run, run_holder, start_problems  # deferred: imports torch (seconds)

    if name not in STAGES:
        raise _fail(ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}"))
    with _expected_errors(2):
        job = open_run(run)
        if name not in trainer_stages(job.trainer):
            raise _fail(
                ValueError(
                    f"{name} is not a stage of trainer {job.trainer!r}; its stages: "
                    f"{', '.join(trainer_stages(job.trainer))}"
                )
            )
        if run_holder(run) is not None:  # before Prefect starts: the holder is named
            raise ConfigError(start_problems(job, run, resume=True))
        last = num_rounds(job)
    lowest = 0 if name == "evaluate" else 1
    if not lowest <= round_ <= last:
        raise _fail(ValueError(f"--round: got {round_}; this run has rounds {lowest}..{last} for {name}"))
    try:
        with _expected_errors(1):
            if no_prefect:
                out = orchestration.run_stage_plain(name, run, round_)
            else:
                out = orchestration.rerun_stage(name, run, round_, force=force)
    except KeyboardInterrupt:
        raise _stopped(f"run it again with `pbrl stage {name} --run {run} --round {round_}`") from None
    state = out["state"]
    word = "cached (nothing recomputed)" if state == "Cached" else "recomputed"
    console.print(f"{name} round {round_}: {state} — {word}")
    console.print(json.dumps(out["manifest"].get("counts", {})))


@app.command()
def status(run: Annotated[Path, typer.Argument(help="Run folder.")]) -> None:
    """Each round's stages: done / cached / failed / missing, with counts and seconds."""
    paths = RunPaths(run)
    if not paths.run_json.is_file():
        raise _fail(ValueError(f"{run} is not a run folder (no run.json)"))
    with _expected_errors(2):  # a malformed manifest or state file is named
        t = Table(title=f"{paths.root.name}: status")
        for col in ("round", "stage", "status", "counts", "seconds"):
            t.add_column(col)
        for r in existing_rounds(paths):
            states = read_states(run, r)
            for s in STAGES:
                m = read_manifest(paths, r, s)
                last = states.get(s, {}).get("state")
                if last == "Failed":
                    label = "[red]failed[/]"
                elif m is None:
                    if s not in states:
                        continue
                    label = "missing"
                else:
                    label = "cached" if last == "Cached" else "done"
                counts = ", ".join(f"{k}={v}" for k, v in (m.counts if m else {}).items())
                t.add_row(str(r), s, label, counts, f"{m.seconds:.1f}" if m else "")
    console.print(t)


@app.command()
def report(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    wide: WideOption = False,
    all_: Annotated[
        bool, typer.Option("--all", help="The wide table, then every metric of metrics.parquet per round.")
    ] = False,
) -> None:
    """Print the round table (pairs, training, eval reward and the paired gain vs round 0 with their 95 %
    intervals, seconds) and write report.png.

    Example: pbrl report storage/runs/demo --wide
    """
    if not (run / "run.json").is_file():
        raise _fail(ValueError(f"{run} is not a run folder (no run.json)"))
    with _expected_errors(2):
        _print_rounds(run, wide=wide, every_metric=all_)


@app.command()
def export(
    run: Annotated[Path, typer.Argument(help="Run folder.")],
    out: Annotated[
        Path, typer.Argument(help="Folder to write, one agent_<i>/ per agent: new, empty, or an earlier export.")
    ],
    round_: Annotated[
        int | None,
        typer.Option(
            "--round",
            help="The policy after this round (0 = the initial one); default: the newest round that has weights.",
        ),
    ] = None,
    merge_lora: Annotated[
        bool, typer.Option("--merge-lora", help="Merge a LoRA adapter into full weights (default: the adapter folder).")
    ] = False,
) -> None:
    """Write each agent's trained policy as a Hugging Face folder (weights or LoRA adapter, tokenizer, model card)
    that AutoModelForCausalLM / peft's AutoPeftModelForCausalLM loads.

    Example: pbrl export storage/runs/tiny-madpo-iter exported --merge-lora
    """
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    orchestration.quiet_libraries()  # before transformers is imported
    from pbrl.run.export import export_agents  # deferred: imports torch and transformers (seconds)

    if not (run / "run.json").is_file():
        raise _fail(ValueError(f"{run} is not a run folder (no run.json)"))
    with _expected_errors(2):
        folders = export_agents(run, out, round_, merge_lora=merge_lora)
    for folder in folders:
        console.print(str(folder))


@app.command()
def serve(
    nightly_run: Annotated[str | None, typer.Option(help="Run name that the nightly deployment extends.")] = None,
    output_dir: Annotated[str, typer.Option(help="Where the nightly run lives.")] = "storage/runs",
    cron: Annotated[str, typer.Option(help="Nightly schedule, cron in UTC.")] = "0 2 * * *",
) -> None:
    """Register and serve the deployments on the Prefect server at PREFECT_API_URL: a run form per trainer
    (pbrl-train/madpo, madpo-iter, marlhf, marlhf-iter), pbrl-train/config-file (a YAML path + overrides),
    pbrl-train/train (the job as JSON) and, with --nightly-run, pbrl-add-iteration/nightly.

    Example: prefect server start & PREFECT_API_URL=http://127.0.0.1:4200/api pbrl serve --nightly-run docs-1
    """
    from prefect.client.schemas.schedules import CronSchedule  # deferred: Prefect (seconds)

    try:  # before any server is contacted; the same check as the server's (Prefect's vendored croniter)
        CronSchedule(cron=cron, timezone="UTC")
    except ValueError:  # pydantic's ValidationError
        raise _fail(
            ValueError(
                f"--cron: got {cron!r}; expected a 5-field cron expression in UTC "
                "(minute hour day-of-month month day-of-week), e.g. '0 2 * * *'"
            )
        ) from None
    if not os.environ.get("PREFECT_API_URL"):
        raise _fail(
            ValueError(
                "PREFECT_API_URL is not set: start `prefect server start` and export "
                "PREFECT_API_URL=http://127.0.0.1:4200/api"
            )
        )
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    orchestration.serve(nightly_run=nightly_run, output_dir=output_dir, cron=cron)


@app.command()
def deploy(
    pool: Annotated[
        str, typer.Option(help="Prefect work pool to register against (created as a 'process' pool when missing).")
    ],
    nightly_run: Annotated[str | None, typer.Option(help="Run name that the nightly deployment extends.")] = None,
    output_dir: Annotated[str, typer.Option(help="Where the nightly run lives.")] = "storage/runs",
    cron: Annotated[str, typer.Option(help="Nightly schedule, cron in UTC.")] = "0 2 * * *",
) -> None:
    """Register the deployments of `pbrl serve` against a Prefect work pool instead of serving them here: runs
    start on the machines that run `prefect worker start --pool NAME` (pbrl installed there; run folders on a
    filesystem every worker shares).

    Example: PREFECT_API_URL=http://head:4200/api pbrl deploy --pool gpu-pool --nightly-run docs-1
    """
    from prefect.client.schemas.schedules import CronSchedule  # deferred: Prefect (seconds)

    try:  # before any server is contacted (as in `pbrl serve`)
        CronSchedule(cron=cron, timezone="UTC")
    except ValueError:
        raise _fail(
            ValueError(
                f"--cron: got {cron!r}; expected a 5-field cron expression in UTC "
                "(minute hour day-of-month month day-of-week), e.g. '0 2 * * *'"
            )
        ) from None
    if not os.environ.get("PREFECT_API_URL"):
        raise _fail(
            ValueError(
                "PREFECT_API_URL is not set: start `prefect server start` and export "
                "PREFECT_API_URL=http://127.0.0.1:4200/api"
            )
        )
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    ids = orchestration.deploy(pool, nightly_run=nightly_run, output_dir=output_dir, cron=cron)
    for name in ids:
        console.print(f"deployed {name} -> work pool {pool}")
    console.print(f"start a worker on each machine: prefect worker start --pool {pool}")


@models_app.command("list")
def models_list() -> None:
    """The packaged models and whether they are prepared."""
    from pbrl.models.packaged import list_packaged_models  # deferred: imports torch and transformers

    t = Table(title="packaged models")
    for col in ("name", "prepared", "folder"):
        t.add_column(col)
    for name, ready, folder in list_packaged_models():
        t.add_row(name, "yes" if ready else "no", str(folder))
    console.print(t)


@models_app.command("prepare")
def models_prepare(name: str) -> None:
    """Convert a packaged model once (GGUF -> safetensors under storage/models/)."""
    from pbrl.models.packaged import prepare_packaged_model  # deferred: imports torch and transformers

    try:
        console.print(f"ready: {prepare_packaged_model(name)}")
    except (KeyError, ImportError, FileNotFoundError, RuntimeError) as exc:
        raise _fail(exc) from None


def main() -> None:  # pragma: no cover
    app()
