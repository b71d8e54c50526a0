"""Issue #53.4: no input file under 100 kB makes ``pbrl validate`` run long or grow without limit. Config YAML is
checked on its composed node graph, aliases expanded, before any value is built; item files are refused when they
cannot be items (nesting past the parser's recursion, a Parquet file that unpacks to gigabytes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pbrl.config import load_job
from pbrl.config.loading import MAX_DEPTH, MAX_VALUES, read_yaml
from pbrl.data.items import load_item_source
from pbrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]
TINY = (ROOT / "flows" / "configs" / "tiny-madpo-iter.yaml").read_text()


def laughs(fanout: int, levels: int, leaf: str = "lol") -> str:
    """A "billion laughs" document: each level lists the one before ``fanout`` times (fanout**levels leaves)."""
    lines = [f"l0: &l0 [{', '.join([leaf] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ntask_options: {{x: *l{levels - 1}}}\n"


# Shapes of unbounded expansion, each file under 100 kB: wide and deep alias trees, long strings repeated through
# aliases, an alias that contains itself, and plain nesting deeper than any config.
BOMBS = {
    "laughs 9x9": laughs(9, 9),
    "laughs 2x40": laughs(2, 40),
    "laughs 200x4": laughs(200, 4),
    "a long string, aliased": f"s0: &s0 '{'x' * 60_000}'\n" + laughs(10, 4, "*s0"),
    "an alias that contains itself": "task_options: &a {x: [*a]}\n",
    "deep nesting": "task_options: " + "[" * 20_000 + "]" * 20_000 + "\n",
    "deep mapping nesting": "task_options: " + "{a: " * 5_000 + "1" + "}" * 5_000 + "\n",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_config_that_expands_without_bound_is_one_problem_naming_the_file(name, tmp_path):
    text = TINY + BOMBS[name]
    assert len(text.encode()) < 100_000
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"config file: got .*bomb.yaml'; is not valid YAML") as caught:
        load_job(path)
    assert "Traceback" not in str(caught.value)


def test_aliases_within_the_bounds_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text(TINY + "agents: [&m tiny-random, *m]\ntask_options: {num_items: &n 4}\nmax_train_items: *n\n")
    job = load_job(path, [f"output_dir={tmp_path}"])
    assert job.agents == ["tiny-random", "tiny-random"] and job.max_train_items == 4
    assert read_yaml(laughs(4, 5)) is not None  # 4**5 = 1,024 leaves: a large config, but a config
    nested = "x: " + "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    assert read_yaml(nested) is not None
    assert MAX_VALUES >= 100_000  # any 100 kB file without aliases fits: it has fewer values than characters


@pytest.mark.parametrize("name", ["laughs 9x9", "deep nesting", "an alias that contains itself"])
def test_pbrl_validate_refuses_each_bomb_in_one_line_without_growing(name, tmp_path):
    """The whole command, in a process of its own: one error line, exit status 2, and a peak RSS of the process that
    stays under 200 MB (torch is never imported for a config's own problems). The peak is the kernel's VmHWM of the
    process image (ru_maxrss would keep the forking test process's peak across exec)."""
    path = tmp_path / "bomb.yaml"
    path.write_text(TINY + BOMBS[name])
    code = (
        "import sys\nfrom pbrl.cli.commands import app\nsys.argv = ['pbrl', 'validate', sys.argv[1]]\n"
        "try:\n    app()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print('peak_mb', int(hwm) / 1024, 'torch' in sys.modules)\nsys.exit(code)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("error:") == 1 and "Traceback" not in done.stderr
    _, peak, torch_imported = done.stdout.split()
    assert float(peak) < 200 and torch_imported == "False", done.stdout


def test_a_deeply_nested_json_item_is_a_problem_not_a_traceback(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text(json.dumps({"topic": "x"}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"items.jsonl:2'; nested too deeply"):
        load_item_source(str(path), field="train_dataset")


def test_a_parquet_file_that_unpacks_to_gigabytes_is_refused_from_its_footer(tmp_path):
    path = tmp_path / "items.parquet"
    rows = 20_000_000  # one repeated value: a few kB on disk, ~180 MB of values once read
    table = pa.table({"topic": pa.array(["x" * 8], pa.string()).take(pa.array([0] * rows))})
    pq.write_table(table, path, compression="zstd")
    assert path.stat().st_size < 100_000
    del table
    with pytest.raises(ConfigError, match=r"20,000,000 rows .* more values than 4 per byte of the file"):
        load_item_source(str(path), field="train_dataset")
