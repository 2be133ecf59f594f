"""The operating point learns TPOT(n) = a + b·n from scrape deltas and answers the limit."""

from __future__ import annotations

import random

from pools.operating_point import OperatingPoint, TpotLine


def test_recovers_a_noisy_line_and_its_limit() -> None:
    rng = random.Random(3)
    op = OperatingPoint(max_num_seqs=64)
    for _ in range(300):
        n = rng.randint(1, 24)
        op.observe(n + rng.uniform(-0.3, 0.3), (0.015 + 0.004 * n) * rng.uniform(0.95, 1.05), 50)
    line = op.line
    assert line is not None and op.source == "measured"
    assert abs(line.intercept_s - 0.015) < 0.004 and abs(line.slope_s - 0.004) < 0.0005
    # 0.015 + 0.004 n <= 0.080  ->  n <= 16.25
    assert op.limit(0.080) in (15, 16, 17)
    assert op.limit(10.0) == 64  # clamped to max_num_seqs
    assert op.limit(0.001) == 1  # never below one


def test_seed_until_two_batch_sizes_and_a_miss_lowers_it() -> None:
    op = OperatingPoint(max_num_seqs=32, seed_limit=12)
    assert op.limit(0.05) == 12 and op.source == "seed"
    op.observe(6, 0.02, 40)
    assert op.limit(0.05) == 12  # one good batch size says nothing about larger ones
    op2 = OperatingPoint(max_num_seqs=32, seed_limit=12)
    op2.observe(6, 0.09, 40)
    assert op2.limit(0.05) == 5  # batch 6 already misses the target


def test_prior_until_measured_and_tiny_samples_ignored() -> None:
    op = OperatingPoint(max_num_seqs=128, prior=TpotLine(0.01, 0.001))
    assert op.source == "prior" and op.limit(0.05) == 40
    op.observe(4, 1.0, 2)  # two tokens: noise, ignored
    op.observe(0.2, 1.0, 100)  # nothing running: ignored
    assert op.samples == 0 and op.limit(0.05) == 40


def test_the_engines_own_ceiling_is_learned_from_waiting_requests() -> None:
    op = OperatingPoint(max_num_seqs=256)
    assert op.limit(0.1) == 256
    op.observe_queue(running=3, waiting=0)
    assert op.limit(0.1) == 256  # nothing waiting: no ceiling seen
    op.observe_queue(running=2, waiting=1)  # a momentary reading
    op.observe_queue(running=4, waiting=5)  # the engine's --max-num-seqs 4
    assert op.saturation == 4 and op.limit(0.1) == 5  # one may wait inside the engine
    op.observe_queue(running=4, waiting=1)  # the one allowed above waits there
    op.observe_queue(running=3, waiting=0)  # fewer running says nothing about the ceiling
    assert op.saturation == 4 and op.limit(0.1) == 5
    op.observe_queue(running=5, waiting=0)  # it took the one more with none waiting
    assert op.saturation is None and op.limit(0.1) == 256


def test_a_wait_that_was_no_ceiling_lets_go_once_the_one_above_runs() -> None:
    # a request waits inside vLLM behind a prefill at 4 running: taken for a ceiling; the
    # limit (5) then lets exactly one more through, and the engine runs it with none waiting
    op = OperatingPoint(max_num_seqs=64)
    op.observe_queue(running=4, waiting=2)
    assert op.limit(0.1) == 5
    op.observe_queue(running=5, waiting=0)
    assert op.saturation is None and op.limit(0.1) == 64


def test_batch_sizes_no_longer_run_stop_shaping_the_line() -> None:
    op = OperatingPoint(max_num_seqs=64)
    for n in range(1, 22):  # someone else's load ran every batch size to 21, slowly
        for _ in range(4):
            op.observe(n, 3 * (0.02 + 0.005 * n), 50)
    assert op.limit(0.157) == 6  # 0.06 + 0.015 n <= 0.157  ->  n <= 6.5
    # now 1 to 6 run (the limit allows no more), at the engine's own speed, 3x what the line
    # says: the batch sizes above, which nothing re-measures, age out
    for i in range(120):
        n = 1 + i % 6
        op.observe(n, 0.02 + 0.005 * n, 50)
    assert sorted(op._buckets) == [1, 2, 3, 4, 5, 6]
    line = op.line
    assert line is not None
    assert abs(line.intercept_s - 0.02) < 1e-3 and abs(line.slope_s - 0.005) < 1e-4
    assert op.limit(0.157) == 27  # 0.02 + 0.005 n <= 0.157  ->  n <= 27.4


def test_nothing_ages_while_the_line_holds_and_the_last_two_are_kept() -> None:
    op = OperatingPoint(max_num_seqs=64)
    for _ in range(200):  # 20 ms + 5 ms per sequence, measured at 2 and at 20 only
        op.observe(2, 0.03, 50)
    op.observe(20, 0.12, 50)  # once, long ago: still holds, since nothing contradicts it
    for _ in range(300):
        op.observe(2, 0.03, 50)
    assert sorted(op._buckets) == [2, 20] and op.limit(0.157) == 27
    op.observe(10, 0.07, 50)
    for _ in range(300):  # 10 and then 2 now run far faster than the line says
        op.observe(2, 0.005, 50)
        op.observe(10, 0.01, 50)
    assert len(op._buckets) == 2 and op.source == "measured"


def test_one_stall_does_not_collapse_the_limit_but_a_lasting_slowdown_lowers_it() -> None:
    rng = random.Random(5)
    op = OperatingPoint(max_num_seqs=64)
    for _ in range(200):
        n = rng.randint(1, 20)
        op.observe(n, 0.01 + 0.002 * n, 50)  # 0.01 + 0.002 n <= 0.05  ->  n <= 20
    before = op.limit(0.05)
    assert before >= 19
    op.observe(19, 0.5, 50)  # the machine stalled for one scrape interval: 10x
    assert op.limit(0.05) >= before - 2
    for _ in range(200):  # the engine really is 3x slower now
        n = rng.randint(1, 20)
        op.observe(n, 3 * (0.01 + 0.002 * n), 50)
    assert op.limit(0.05) <= 5  # 0.03 + 0.006 n <= 0.05  ->  n <= 3


def test_tpot_estimate_from_one_batch_size_then_the_line() -> None:
    op = OperatingPoint(max_num_seqs=32)
    assert op.tpot_estimate_s(1) is None  # nothing measured, no prior
    op.observe(6, 0.02, 40)
    assert op.tpot_estimate_s(1) == 0.02  # one batch size: its TPOT, whatever the batch
    op.observe(2, 0.01, 40)
    # the line through (2, 10 ms) and (6, 20 ms): 5 ms + 2.5 ms per sequence
    assert abs((op.tpot_estimate_s(4) or 0.0) - 0.015) < 1e-9
    with_prior = OperatingPoint(max_num_seqs=32, prior=TpotLine(0.01, 0.001))
    assert abs((with_prior.tpot_estimate_s(10) or 0.0) - 0.02) < 1e-9
