"""torch's threads: the CPUs a process owns (affinity, cgroup quota), and the load follower that gives CPUs back
while other processes keep them busy (pbrl/models/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from pbrl.models import cpus, thread_placement, threads
from pbrl.models.cpus import available_cpus, busy_cpu_seconds, cgroup_cpu_limit, cgroup_cpu_seconds, load_meter
from pbrl.models.threads import FollowerHooks, LoadFollower, configure_threads, one_thread


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    """Each test starts without a follower; torch's count is put back after it."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_follower", None)
    monkeypatch.setattr(threads, "_spread_over", None)
    yield
    torch.set_num_threads(before)


def test_cgroup_quota_of_v2_and_v1_in_cpus(tmp_path, monkeypatch):
    v2 = tmp_path / "cpu.max"
    monkeypatch.setattr(cpus, "_CGROUP_V2", v2)
    quota, period = tmp_path / "quota", tmp_path / "period"
    monkeypatch.setattr(cpus, "_CGROUP_V1", (quota, period))
    v2.write_text("150000 100000\n")
    assert cgroup_cpu_limit() == 1.5
    v2.write_text("max 100000\n")
    assert cgroup_cpu_limit() is None
    v2.unlink()  # no v2 file: v1's quota / period
    quota.write_text("250000\n")
    period.write_text("100000\n")
    assert cgroup_cpu_limit() == 2.5
    quota.write_text("-1\n")  # v1's "unlimited"
    assert cgroup_cpu_limit() is None


def test_available_cpus_is_the_affinity_mask_capped_by_the_quota_rounded_up(monkeypatch):
    monkeypatch.setattr(cpus, "affinity", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    assert available_cpus() == 4
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.5)
    assert available_cpus() == 2
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 0.2)
    assert available_cpus() == 1


STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 20 30 4000 5 1 2 3 50 0
cpu1 200 0 100 1000 5 0 0 7 0 0
cpu2 600 0 170 0 0 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_count_user_system_irq_softirq_and_nice_if_asked_of_the_named_cpus(monkeypatch):
    monkeypatch.setattr(os, "sysconf", lambda name: 100)  # USER_HZ
    # cpu0: user 100 + nice 20 + system 30 + irq 1 + softirq 2 = 153 ticks (idle 4000, iowait 5 and steal 3 are
    # not counted; guest 50 is inside user already)
    assert busy_cpu_seconds({0}, STAT) == pytest.approx(1.53)
    assert busy_cpu_seconds({0}, STAT, count_nice=False) == pytest.approx(1.33)
    # cpu1: 200 + 100 = 300 ticks (steal 7 not counted)
    assert busy_cpu_seconds({0, 1}, STAT) == pytest.approx(4.53)
    assert busy_cpu_seconds({7}, STAT) is None  # no line of that CPU


def test_cgroup_usage_in_seconds_from_v2_then_v1(tmp_path, monkeypatch):
    v2, v1 = tmp_path / "cpu.stat", tmp_path / "cpuacct.usage"
    monkeypatch.setattr(cpus, "_CGROUP_V2_USAGE", v2)
    monkeypatch.setattr(cpus, "_CGROUP_V1_USAGE", v1)
    assert cgroup_cpu_seconds() is None
    v1.write_text("2500000000\n")  # nanoseconds
    assert cgroup_cpu_seconds() == pytest.approx(2.5)
    v2.write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")  # microseconds
    assert cgroup_cpu_seconds() == pytest.approx(1.5)


def test_load_meter_measures_the_quota_under_a_cgroup_limit_else_the_listed_cpus(monkeypatch):
    monkeypatch.setattr(cpus, "cgroup_cpu_seconds", lambda: 7.0)
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 2.0)  # --cpus=2 on a 64-CPU host
    meter = load_meter(range(64))
    assert meter is not None and meter.capacity == 2.0 and meter.busy() == 7.0
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.5)
    assert load_meter(range(64)) is None  # under 2 CPUs: nothing to follow
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(cpus, "_PROC_STAT", type("Stat", (), {"read_text": staticmethod(lambda: STAT)}))
    meter = load_meter({0, 1, 5})  # cpu5 has no line (a container's renumbered view): not counted
    assert meter is not None and meter.capacity == 2.0
    assert load_meter({0, 5}) is None


class Machine:
    """A fake clock and CPU counters with a follower on them (``owned`` threads at most, ``cpus`` to share).
    ``look(seconds, others, own)`` runs the machine for ``seconds`` with other processes using ``others`` CPUs and
    this one ``own``, then ticks the follower; it returns the follower's thread count."""

    def __init__(self, owned: int = 2, cpus: int = 2, interval_s: float = 1.0, pinned: bool = False) -> None:
        self.now, self.busy, self.own = 100.0, 5000.0, 10.0
        self.set_calls: list[int] = []
        self.free = False  # whether the work is one whose results do not depend on the thread count
        self.follower = LoadFollower(
            owned,
            float(cpus),
            lambda: self.busy,
            interval_s=interval_s,
            pinned=pinned,
            hooks=FollowerHooks(
                own=lambda: self.own,
                clock=lambda: self.now,
                set_threads=self.set_calls.append,
                free=lambda: self.free,
            ),
        )

    def look(self, seconds: float, others: float, own: float) -> int:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds
        self.follower.tick()
        return self.follower.threads


def test_follower_gives_a_busy_cpu_back_at_once_and_takes_it_again_after_two_free_looks():
    m = Machine()
    assert m.follower.threads == 2 and m.set_calls == [2]
    assert m.look(1.0, others=0.1, own=1.9) == 2  # alone (a little noise): free 1.9 -> 2
    assert m.look(1.0, others=1.0, own=1.0) == 1  # another process spins on one core: free 1.0 -> 1
    assert m.set_calls == [2, 1]
    m.look(0.5, others=0.0, own=1.0)  # within the interval: no look
    assert m.look(0.6, others=0.0, own=1.0) == 1  # the other process ended: a first free look is not enough
    assert m.look(1.0, others=0.15, own=1.0) == 2  # second free look in a row (free 1.85 -> 2): back to 2
    assert m.set_calls == [2, 1, 2]


def test_follower_needs_two_free_looks_in_a_row_and_never_goes_below_one():
    m = Machine()
    assert m.look(1.0, others=0.6, own=1.4) == 1  # free 1.4 rounds to 1
    m.look(1.0, others=0.0, own=1.0)  # one free look ...
    m.look(1.0, others=1.0, own=1.0)  # ... then busy again: the vote starts over
    assert m.look(1.0, others=0.0, own=1.0) == 1
    assert m.look(1.0, others=5.0, own=1.0) == 1  # more load than CPUs: still one thread
    assert m.set_calls == [2, 1]


def test_follower_has_a_dead_band_a_cpu_is_free_again_only_under_a_fifth_used():
    """A neighbour wavering around a quarter of a CPU (0.21 .. 0.6) does not make the count flap; one that takes
    more than a third of a CPU takes it (an equal-priority neighbour gets half of a CPU shared with a pinned thread)."""
    m = Machine()
    assert m.look(1.0, others=0.3, own=1.7) == 2  # under a third: not taken
    assert m.look(1.0, others=0.5, own=1.5) == 1  # half a CPU: taken
    counts = [m.look(1.0, others=others, own=1.0) for others in (0.3, 0.25, 0.34, 0.21, 0.3, 0.6, 0.22) * 3]
    assert set(counts) == {1} and m.set_calls == [2, 1]
    assert [m.look(1.0, others=others, own=1.0) for others in (0.1, 0.19)] == [1, 2]


def test_follower_with_no_interval_looks_every_tick_without_dividing_by_zero():
    m = Machine(interval_s=0.0)
    assert m.look(0.0, others=0.0, own=0.0) == 2  # no time has passed: no look
    assert m.look(0.5, others=1.0, own=1.0) == 1


def test_follower_counts_free_cpus_of_the_whole_mask_and_keeps_within_what_it_owns():
    """A Ray-like node: 16 CPUs in the mask, 4 owned; others busy on 12 leave 4 free -> keeps 4; on 13 -> 3."""
    m = Machine(owned=4, cpus=16)
    assert m.look(1.0, others=12.0, own=4.0) == 4
    assert m.look(1.0, others=13.0, own=3.0) == 3


def test_usage_since_is_the_time_weighted_mean_and_the_fewest():
    m = Machine()
    start = m.now
    m.look(2.0, others=0.0, own=2.0)  # 2 threads for 2 s
    m.look(1.0, others=1.0, own=1.0)  # 2 threads for 1 more s, lowered to 1 at t = 3
    m.now += 1.0  # 1 thread for 1 s (now t = 4)
    mean, lowest = m.follower.usage_since(start)
    assert mean == pytest.approx((2 * 3 + 1 * 1) / 4) and lowest == 1
    assert m.follower.usage_since(start + 3.5) == (pytest.approx(1.0), 1)
    assert m.follower.usage_since(start - 10) == (pytest.approx(7 / 4), 1)  # nothing before the follower existed


def test_follower_applies_its_count_in_each_thread_that_ticks():
    """OpenMP's count is per calling thread: work in a thread that ran torch before the change gets it there."""
    m = Machine()
    assert m.look(1.0, others=1.0, own=1.0) == 1 and m.set_calls == [2, 1]
    worker = threading.Thread(target=m.follower.tick)
    worker.start()
    worker.join()
    assert m.set_calls == [2, 1, 1]
    m.follower.tick()  # the first thread already has it
    assert m.set_calls == [2, 1, 1]


def test_a_pinned_follower_follows_only_where_results_do_not_depend_on_the_count():
    """A bfloat16 job: training (not free) keeps the 2 owned threads beside a busy neighbour, while the follower
    goes on looking; sampling (free) starts with the count the load leaves; back in training the owned count is in
    use again."""
    m = Machine(pinned=True)
    assert m.look(1.0, others=1.0, own=1.0) == 2 and m.set_calls == [2]  # training: 2 threads
    assert m.follower.followed == 1  # what the load leaves
    m.free = True
    m.follower.apply()  # entering a sampling (results_independent_of_threads)
    assert m.follower.threads == 1 and m.set_calls == [2, 1]
    assert m.look(1.0, others=1.0, own=1.0) == 1
    m.free = False
    m.follower.apply()  # leaving it
    assert m.follower.threads == 2 and m.set_calls == [2, 1, 2]
    assert m.look(1.0, others=0.0, own=2.0) == 2 and m.look(1.0, others=0.0, own=2.0) == 2  # two free looks ...
    assert m.follower.followed == 2 and m.set_calls == [2, 1, 2]  # ... in training: nothing to change
    m.free = True
    assert m.look(1.0, others=1.0, own=1.0) == 1 and m.set_calls == [2, 1, 2, 1]  # sampling: given back at once


def test_results_independent_of_threads_applies_the_followed_count_inside_and_the_owned_after(monkeypatch):
    m = Machine(pinned=True, interval_s=0.0)
    m.follower._free = lambda: threads._INDEPENDENT.get()
    m.follower.followed = 1
    monkeypatch.setattr(threads, "_follower", m.follower)
    with threads.results_independent_of_threads():
        assert m.follower.threads == 1
        with pytest.raises(RuntimeError):
            with threads.results_independent_of_threads():
                raise RuntimeError("a failed sampling")
        assert m.follower.threads == 1  # the outer block still holds
    assert m.follower.threads == 2 and m.set_calls == [2, 1, 2]


def test_configure_threads_fixed_count_has_no_follower_and_unset_follows_the_load(monkeypatch):
    monkeypatch.setattr(threads, "gemm_independent_of_threads", lambda: True)  # as under MKL's strict mode
    monkeypatch.setattr(cpus, "affinity", lambda: {0, 1})
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(cpus, "busy_cpu_seconds", lambda cpus, stat=None, count_nice=True: 1.0)
    assert configure_threads(1) == 1 and threads._follower is None and torch.get_num_threads() == 1
    assert threads.thread_usage(time.monotonic()) == (1.0, 1, 0)
    assert configure_threads(None) == 2 and torch.get_num_threads() == 2
    assert threads._follower is not None and threads._follower.owned == 2
    monkeypatch.setattr(cpus, "affinity", lambda: {0})  # one CPU: nothing to follow
    assert configure_threads(None) == 1 and threads._follower is None
    with pytest.raises(ValueError, match="num_threads: got 0"):
        configure_threads(0)


def test_configure_threads_follows_the_load_only_where_the_count_cannot_change_a_product(monkeypatch):
    """Without MKL's strict reproducibility mode a matrix product's bits may change with the thread count: the
    count then stays at the CPUs the process owns, and the user is told why."""
    monkeypatch.setattr(cpus, "affinity", lambda: {0, 1})
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(cpus, "busy_cpu_seconds", lambda cpus, stat=None, count_nice=True: 1.0)
    monkeypatch.setattr(threads, "gemm_independent_of_threads", lambda: False)
    with pytest.warns(UserWarning, match=r"thread count stays at 2, .*MKL_CBWR=AUTO,STRICT"):
        assert configure_threads(None) == 2
    assert threads._follower is None and torch.get_num_threads() == 2


@pytest.mark.parametrize(
    ("torch_dtype", "mixed_precision", "pinned"),
    [("float32", "no", False), ("bfloat16", "no", True), ("float32", "bf16", True)],
)
def test_a_job_in_low_precision_follows_the_load_only_in_row_invariant_work(
    tiny_model_dir, tmp_path, monkeypatch, torch_dtype, mixed_precision, pinned
):
    """bfloat16 and float16 products on a CPU go through oneDNN, which MKL's strict mode does not govern: a job that
    computes in them keeps the count it owns except in row-invariant forwards (sampling, evaluation), whose bits do
    not depend on the count (issue #57: before, it never followed, and sampling beside a busy neighbour took 3.3x)."""
    from pbrl.run.settings import configure_job_threads
    from tests.helpers import tiny_job

    monkeypatch.setattr(threads, "gemm_independent_of_threads", lambda: True)
    monkeypatch.setattr(cpus, "affinity", lambda: {0, 1})
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    monkeypatch.setattr(cpus, "busy_cpu_seconds", lambda cpus, stat=None, count_nice=True: 1.0)
    job = tiny_job(tiny_model_dir, tmp_path, torch_dtype=torch_dtype, mixed_precision=mixed_precision)
    assert configure_job_threads(job) == 2 and torch.get_num_threads() == 2
    assert threads._follower is not None and threads._follower.pinned == pinned


PRODUCTS_BY_THREADS = """
import pbrl, torch
from pbrl.models.threads import gemm_independent_of_threads
g = torch.Generator().manual_seed(0)
w, x = torch.randn(1536, 576, generator=g), torch.randn(24, 576, generator=g)  # SmolLM2's MLP shape
def products(count):
    torch.set_num_threads(count)
    return [torch.nn.functional.linear(x[:m], w) for m in range(1, 25)]
one, two = products(1), products(2)
print(gemm_independent_of_threads(), [m + 1 for m in range(24) if not torch.equal(one[m], two[m])])
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without oneMKL")
@pytest.mark.parametrize(("setting", "expected"), [(None, "True []"), ("", "True []"), ("AUTO", "False")])
def test_import_pbrl_makes_products_of_any_row_count_independent_of_the_thread_count(setting, expected):
    """The failing input (2026-12-04): a product of 5-7 or 9-11 rows, a decode step of a sampling batch that size,
    gave other bits on 1 and 2 threads. After ``import pbrl`` (MKL's strict mode) every row count from 1 to 24 gives
    the same bits, also when ``MKL_CBWR`` is set empty (MKL reads that as unset); where the user sets another mode,
    pbrl does not override it and knows the mode is off."""
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"} | ({} if setting is None else {"MKL_CBWR": setting})
    out = subprocess.run(
        [sys.executable, "-c", PRODUCTS_BY_THREADS], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().startswith(expected), out.stdout


BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def _others_use(cpus: list[int], seconds: float) -> float:
    """CPUs of ``cpus`` other processes kept busy over the next ``seconds`` (this one sleeps meanwhile)."""
    before = busy_cpu_seconds(cpus)
    time.sleep(seconds)
    return (busy_cpu_seconds(cpus) - before) / seconds


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_follower_on_this_machine_gives_a_cpu_to_a_busy_neighbour_and_takes_it_back():
    """Real /proc/stat: a process spinning on one of two CPUs leaves one free; once it ends, two. Skipped where
    other work already keeps those CPUs busy (the test would measure that work, not the neighbour)."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2 or busy_cpu_seconds(cpus) is None:
        pytest.skip("needs two CPUs and /proc/stat")
    if (load := _others_use(cpus, 1.0)) > 0.2:
        pytest.skip(f"CPUs {cpus} are busy with other work ({load:.2f} CPUs)")
    f = LoadFollower(2, 2.0, lambda: busy_cpu_seconds(cpus), interval_s=0.5)
    neighbour = subprocess.Popen([sys.executable, "-c", BUSY, str(cpus[0])])
    try:
        deadline = time.monotonic() + 10
        while f.threads == 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            f.tick()
        assert f.threads == 1 and torch.get_num_threads() == 1
    finally:
        neighbour.kill()
        neighbour.wait()
    deadline = time.monotonic() + 10
    while f.threads == 1 and time.monotonic() < deadline:
        time.sleep(0.1)
        f.tick()
    assert f.threads == 2 and torch.get_num_threads() == 2


def test_reward_head_svd_runs_on_one_thread_whatever_the_count():
    """LAPACK's float64 SVD differs in its last bits between 1 and 2 threads: the segments head's projection runs it
    on one thread, so the follower cannot change it; the count is restored after."""
    from pbrl.learning.segment_head import segment_projection

    features = torch.randn(64, 2 * 65, generator=torch.Generator().manual_seed(0))
    features = (features - features.mean(0)) / features.std(0)
    projections, factors = [], []
    for count in (1, 2):
        torch.set_num_threads(count)
        projections.append(segment_projection(features, 2, 4))
        with one_thread():
            factors.append(torch.linalg.svd(features[:, :64].double(), full_matrices=False)[2])
        assert torch.get_num_threads() == count
    assert torch.equal(projections[0], projections[1]) and torch.equal(factors[0], factors[1])


def test_results_do_not_depend_on_the_thread_count(tiny_model_dir, tmp_path):
    """What the follower relies on: sampled tokens, log-probs and their gradients are bitwise the same with 1 and
    2 threads (also checked on the demo round with SmolLM2, docs/results/benchmarks.md). The tiny model widened
    (hidden 256, MLP 1024) so that its matmuls and its gradients' accumulations are split between threads; batches of
    1 to 12 rows, since MKL splits a product of 5-7 or 9-11 rows by thread count unless in its strict mode."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from pbrl.generation.sampling import SamplingSettings, generate
    from pbrl.learning.logprobs import completion_token_logprobs
    from pbrl.models.loading import load_model, load_tokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 1024, 64
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for f in tiny_model_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, tmp_path / f.name)
    model, tok = load_model(tmp_path, trainable=True), load_tokenizer(tmp_path)
    prompts = [[5, 6, 7, 8, 9] * 8, [11, 12, 13] * 10]
    settings = SamplingSettings(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=20, batch_size=8)
    results, one_token_logits = [], []
    for count in (1, 2):
        torch.set_num_threads(count)
        with torch.no_grad():  # a decode step's products: one token per row
            one_token_logits.append(
                [model(input_ids=torch.tensor([[5 + r] for r in range(m)])).logits for m in range(1, 13)]
            )
        tokens = generate(model, tok, prompts * 2, [3, 4, 5, 6], settings) + generate(
            model,
            tok,
            prompts * 3 + prompts[:1],
            list(range(7, 14)),
            settings,  # a batch of 7 rows
        )
        model.zero_grad()
        logps, mask = completion_token_logprobs(model, prompts, [[1, 2, 3] * 20, [4] * 30], pad_token_id=0)
        (logps * mask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((tokens, logps.detach(), grads))
    (tokens_1, logps_1, grads_1), (tokens_2, logps_2, grads_2) = results
    assert [m for m in range(12) if not torch.equal(one_token_logits[0][m], one_token_logits[1][m])] == []
    assert tokens_1 == tokens_2
    assert torch.equal(logps_1, logps_2)
    assert all(torch.equal(a, b) for a, b in zip(grads_1, grads_2, strict=True))


def test_bfloat16_sampling_gives_the_same_tokens_whatever_the_thread_count_and_its_changes(tiny_model_dir, monkeypatch):
    """What a pinned follower relies on: row-invariant sampling (pbrl/models/row_invariance.py) samples the same
    tokens with 1 thread, 2 threads, and a count that changes every token (a follower whose neighbour comes and
    goes), for batches of 1 to 9 rows with prompts of different lengths."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import pbrl.generation.seeded_sampler as seeded_sampler
    from pbrl.generation.sampling import SamplingSettings, encode_prompt, generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [encode_prompt(tok, text) for text in ("apples", "a longer prompt about pears and plums", "figs")]
    settings = SamplingSettings(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=20, batch_size=9)

    def sample() -> list:
        return [generate(model, tok, (prompts * 3)[:n], list(range(n)), settings) for n in (1, 2, 5, 9)]

    torch.set_num_threads(1)
    one = sample()
    torch.set_num_threads(2)
    two = sample()
    flips = iter([1, 2] * 1000)
    monkeypatch.setattr(seeded_sampler, "follow_load", lambda: torch.set_num_threads(next(flips)))
    flipping = sample()
    assert one == two == flipping


# ---------------------------------------------------------------------- issue #57: a CPU per thread
OWNED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _in_a_thread(body):
    """``body()`` in a thread of its own (its pins never reach pytest's thread): its result, or its error raised."""
    out = {}

    def run():
        try:
            out["value"] = body()
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.skipif(len(OWNED) < 2 or thread_placement._libgomp() is None, reason="needs 2 CPUs and torch's libgomp")
def test_inside_a_stage_a_thread_per_cpu_owned_gets_a_cpu_each_and_every_cpu_back_below_it_and_after():
    """Beside a niced busy loop Linux stacked torch's two threads on one CPU (a round took 8.7x its time alone):
    inside pinning() (a stage's run) thread k of the team runs on the k-th CPU owned while the count is one per CPU;
    with fewer threads, after the stage, and outside it, the threads have every CPU owned."""

    def body():
        configure_threads(len(OWNED))
        x = torch.randn(300, 300)
        expected = x @ x
        team = thread_placement.team_thread_ids(len(OWNED))
        seen = {"caller": threading.get_native_id(), "outside": None}
        threads.follow_load()  # outside a stage: nothing pinned
        seen["outside"] = [os.sched_getaffinity(t) for t in team]
        with thread_placement.pinning():
            threads.follow_load()
            seen["pinned"] = [os.sched_getaffinity(t) for t in team]
            seen["same"] = torch.equal(x @ x, expected)  # the same threads compute the same bits
            torch.set_num_threads(1)  # the follower left one thread
            threads.follow_load()
            seen["one"] = [os.sched_getaffinity(t) for t in team]
            torch.set_num_threads(len(OWNED))
            threads.follow_load()
            seen["again"] = [os.sched_getaffinity(t) for t in team]
        seen["after"] = [os.sched_getaffinity(t) for t in team]
        return team, seen

    team, seen = _in_a_thread(body)
    every = [set(OWNED)] * len(OWNED)
    assert team[0] == seen["caller"] and len(set(team)) == len(OWNED)
    assert seen["outside"] == every
    assert seen["pinned"] == [{cpu} for cpu in OWNED] and seen["same"]
    assert seen["one"] == every and seen["again"] == [{cpu} for cpu in OWNED]
    assert seen["after"] == every and thread_placement._PINNED.get(seen["caller"]) is None


def test_without_libgomp_or_below_a_thread_per_cpu_nothing_is_pinned(monkeypatch):
    monkeypatch.setattr(thread_placement, "_libgomp", lambda: None)  # not found in this process
    assert thread_placement.team_thread_ids(2) is None
    assert not thread_placement.place_threads(2, [0, 1])
    assert not thread_placement.place_threads(1, [0, 1]) and not thread_placement.place_threads(2, None)


@pytest.mark.skipif(len(OWNED) < 2 or thread_placement._libgomp() is None, reason="needs 2 CPUs and torch's libgomp")
def test_the_oracle_scores_from_a_thread_with_every_cpu_so_its_worker_process_inherits_them():
    """A reward runs in a forked worker (and a sandbox): a process inherits its parent thread's CPU mask, so the
    evaluation's scoring, after its sampling pinned the thread, releases the pins first."""
    from pbrl.preference.oracle import Oracle

    def cpus_seen(*completions, **kwargs):
        return [float(len(os.sched_getaffinity(0)))] * len(completions[0])

    def body():
        configure_threads(len(OWNED))
        with thread_placement.pinning():
            threads.follow_load()
            pinned = os.sched_getaffinity(0)
            with Oracle(cpus_seen, None, timeout_s=30.0) as oracle:  # in a forked worker
                scores = oracle.score([["a", "b"]])
        return pinned, [s.reward for s in scores]

    pinned, rewards = _in_a_thread(body)
    assert pinned == {OWNED[0]} and rewards == [float(len(OWNED))] * 2
