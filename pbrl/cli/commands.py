"""The ``pbrl`` command line (typer): the commands that make, run and read a run (``validate``, ``train``,
``stage``, ``status``, ``report``, ``export``; ``label``, people's labels in the terminal, is :mod:`pbrl.cli.label`).
What they print (consoles, error lines and exit codes, the round
table, the live display of a run) is :mod:`pbrl.cli.display`; ``serve``, ``deploy`` and ``models``, which set
things up, are :mod:`pbrl.cli.setup`, registered here.

Imports that cost seconds (torch, transformers, Prefect, matplotlib) happen inside the commands that need them,
each saying why, so that ``pbrl --help``, ``pbrl status`` and ``pbrl validate``'s config errors answer at once.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from pbrl.cli.display import _expected_errors, _fail, _print_rounds, _stopped, _train_with_progress, console, err
from pbrl.cli.label import label
from pbrl.cli.setup import deploy, models_app, serve
from pbrl.config import ConfigNotice, JobConfig, is_centralized, load_job, num_rounds
from pbrl.data.run_health import damage_lines, damaged_outputs
from pbrl.data.storage import STAGES, RunPaths, existing_rounds, read_manifest, read_states
from pbrl.distributed.shards import require_ray_extra
from pbrl.errors import ConfigError

app = typer.Typer(
    help="pbrl: train cooperating LLM agents from preferences between their joint responses.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(models_app, name="models")

SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a config option: key=value (repeatable).")]


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
    with _expected_errors(2):
        job = _load(config, set_)  # a config's own problems are said before torch is imported
        from pbrl.run.preflight import preflight  # deferred: imports torch and transformers (seconds)

        preflight(job, prepare_models=False)  # task, import paths, datasets and models exist
    agents = f"{job.num_agents} roles, one actor" if is_centralized(job) else f"{job.num_agents} agents"
    console.print(f"OK: {config} ({job.trainer}, {agents})")


WideOption = Annotated[
    bool, typer.Option("--wide", help="Every column of the round table (default: the ones that fit 80 columns).")
]


def _runner_set(runner: str | None) -> list[str]:
    """``--runner X`` as the override ``runner=X`` (validated with every other option); another runner than ray
    also clears ``ray_address``, which only ray reads."""
    if runner is None:
        return []
    return [f"runner={runner}"] + ([] if runner == "ray" else ["ray_address="])


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

    verbosity = _verbosity(config, run, resume=resume, quiet=quiet, verbose=verbose)
    orchestration.quiet_libraries()  # before preflight, which may build or convert a packaged model
    folder: Path | None = run
    try:
        with _expected_errors(2):
            job, folder = _job_to_train(config, [*(set_ or []), *_runner_set(runner)], run_name, run, quiet=quiet)
            _check_start(job, folder, resume=resume, quiet=quiet)
        orchestration.mark_interrupts()
        with _expected_errors(1):
            out = _train_with_progress(job, resume, verbosity)
    except BaseException as exc:
        if isinstance(exc, typer.Exit) or not orchestration.interrupted(exc):
            raise
        raise _stopped(_after_interrupt(folder)) from None
    # The stages' messages were said as each stage ended (RunDisplay).
    with _expected_errors(1):
        _print_rounds(Path(out["run_dir"]), wide=wide)


def _verbosity(config: Path | None, run: Path | None, *, resume: bool, quiet: bool, verbose: bool) -> str:
    """``"quiet"``, ``"verbose"`` or ``"normal"``, once ``pbrl train``'s options are checked together.

    Raises:
        typer.Exit: (code 2, the line said) ``--run`` without ``--resume``, neither CONFIG nor ``--run``, or both
            ``--quiet`` and ``--verbose``.
    """
    if run is not None and not resume:
        raise _fail(ValueError("--run continues an existing run: add --resume"))
    if run is None and config is None:
        raise _fail(ValueError("give a CONFIG file, or --run RUN --resume"))
    if quiet and verbose:
        raise _fail(ValueError("--quiet and --verbose: give one of them"))
    return "quiet" if quiet else "verbose" if verbose else "normal"


def _job_to_train(
    config: Path | None, overrides: list[str], run_name: str | None, run: Path | None, *, quiet: bool
) -> tuple[JobConfig, Path]:
    """The job ``pbrl train`` runs and its run folder: CONFIG with ``overrides`` (its own problems said before
    Prefect and torch load), or the job stored in ``run`` (``overrides`` may change what a resume may change).

    Raises:
        ConfigError: the config's or the stored run's problems.
    """
    from pbrl import orchestration  # deferred: Prefect reads settings that orchestration sets first

    job = _load(config, overrides, run_name, quiet=quiet) if run is None else None
    # The temporary server starts while torch and transformers are imported (seconds each).
    orchestration.prepare_prefect()
    from pbrl.run.folder import open_run, run_dir_for  # deferred: imports torch (seconds)

    if run is not None:
        return open_run(run, overrides), run
    return job, run_dir_for(job)


def _check_start(job: JobConfig, folder: Path, *, resume: bool, quiet: bool) -> None:
    """What must hold before Prefect starts, said in one clear message: the run folder may be started or resumed,
    the task, items and models are there (a resumed run reads its stored items; a new one's are loaded and
    formatted here), and Ray is installed when the job runs on it.

    Raises:
        ConfigError: every problem found.
    """
    from pbrl.run.folder import start_problems  # deferred: imports torch (seconds)
    from pbrl.run.preflight import preflight  # deferred: imports torch and transformers (seconds)

    problems = start_problems(job, folder, resume=resume)
    if problems:
        raise ConfigError(problems)
    if resume and not (folder / "run.json").is_file() and not quiet:
        err.print(f"note: no run at {folder} yet: starting it")
    stored = folder / "items.parquet"
    preflight(job, check_items=not (resume and stored.is_file()))
    require_ray_extra(job.runner)


def _after_interrupt(folder: Path | None) -> str:
    """What to do after Ctrl-C stopped ``pbrl train``: Prefect has recorded the run as crashed; finished stages are
    kept and come back cached when it is resumed."""
    if folder is not None and (folder / "run.json").is_file():
        return f"resume with `pbrl train --run {folder} --resume`"
    return "nothing was stored; start the run again"


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
    if name not in STAGES:
        raise _fail(ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}"))
    if not no_prefect:
        orchestration.prepare_prefect()  # the temporary server starts while torch and the flows are imported
    from pbrl.run.folder import open_run, run_holder, start_problems  # deferred: imports torch (seconds)
    from pbrl.run.judging import round_stages  # deferred with the run folder's code

    with _expected_errors(2):
        job = open_run(run)
        stages = round_stages(job, run)
        if name not in stages:
            message = f"{name} is not a stage of this run ({job.trainer}); its stages: {', '.join(stages)}"
            raise _fail(ValueError(message))
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
    """Each round's stages: done / cached / damaged / failed / missing, with counts and seconds; then every damaged
    output and unexpected round folder with its fix (exit code 1 when there is one)."""
    paths = RunPaths(run)
    if not paths.run_json.is_file():
        raise _fail(ValueError(f"{run} is not a run folder (no run.json)"))
    with _expected_errors(2):  # a malformed manifest or state file is named
        rounds = existing_rounds(paths)
        t = Table(title=f"{paths.root.name}: status")
        for col in ("round", "stage", "status", "counts", "seconds"):
            t.add_column(col)
        for r in rounds:
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
                elif damaged_outputs(paths, m, r, s):
                    label = "[red]damaged[/]"
                else:
                    label = "cached" if last == "Cached" else "done"
                counts = ", ".join(f"{k}={v}" for k, v in (m.counts if m else {}).items())
                if last == "AwaitingLabels" and m is None:
                    label = "[yellow]waiting for labels[/]"
                t.add_row(str(r), s, label, counts, f"{m.seconds:.1f}" if m else "")
        damage = damage_lines(paths)
    console.print(t)
    _print_waiting(paths)
    for line in damage:
        err.print(f"[bold red]damaged:[/] {escape(line)}")
    if damage:
        raise typer.Exit(1)


def _print_waiting(paths: RunPaths) -> None:
    """A line per round that waits for people's labels, with the link to its form."""
    if not any((paths.root / "rounds").glob("*/labels.json")):
        return
    from pbrl.run.labelling import waiting_words  # deferred: imports the run's task code (torch)

    for line in waiting_words(paths):
        console.print(f"[yellow]{escape(line)}[/]", soft_wrap=True)


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
        damage = damage_lines(RunPaths(run))
        _print_rounds(run, wide=wide, every_metric=all_)
    for line in damage:  # the table is shown, and what in it cannot be trusted is named after it
        err.print(f"[bold red]damaged:[/] {escape(line)}")


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


# serve, deploy and models set things up (pbrl.cli.setup); registered here, after the run commands.
app.command()(serve)
app.command()(deploy)
app.command()(label)


def main() -> None:  # pragma: no cover
    app()
