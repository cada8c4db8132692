"""Live per-stage busy time: the worker's BusyTimer (CPU) and the bubble window of /metrics."""

from __future__ import annotations

import time

import pytest
import torch

from pipeserve.runtime.bench.metrics import BubbleWindow
from pipeserve.runtime.worker.worker import BusyTimer


def test_window_before_any_work_has_no_figure():
    w = BubbleWindow(10.0)
    assert w.bubble_fractions() is None
    w.add([0.0, 0.0], active_s=0.0)
    assert w.bubble_fractions() is None
    w.add([0.0, 0.0], active_s=0.0)  # idle: the window does not move
    assert w.bubble_fractions() is None


def test_window_is_one_minus_busy_over_active():
    w = BubbleWindow(10.0)
    w.add([0.0, 0.0], active_s=0.0)
    w.add([1.5, 0.5], active_s=2.0)
    assert w.bubble_fractions() == pytest.approx([0.25, 0.75])
    w.add([3.5, 1.5], active_s=4.0)
    assert w.bubble_fractions() == pytest.approx([1 - 3.5 / 4, 1 - 1.5 / 4])


def test_window_slides_over_active_time_only():
    w = BubbleWindow(10.0)
    busy = 0.0
    for active in range(0, 21):  # 20 s of work: all busy for 10 s, then half busy for 10 s
        w.add([busy], active_s=float(active))
        busy += 1.0 if active < 10 else 0.5
    assert w.bubble_fractions() == pytest.approx([0.5])  # only the last 10 s count
    # Idle for a long while: the figure holds (idle is no bubble), and no samples pile up.
    for _ in range(1000):
        w.add([busy - 0.5], active_s=20.0)
    assert w.bubble_fractions() == pytest.approx([0.5])
    assert len(w._samples) <= 12


def test_late_busy_report_counts_for_the_work_it_belongs_to():
    w = BubbleWindow(10.0)
    w.add([0.0], active_s=0.0)
    w.add([1.0], active_s=4.0)  # the stage's heartbeat trails: 1 of 3 busy seconds so far
    assert w.bubble_fractions() == pytest.approx([0.75])
    w.add([3.0], active_s=4.0)  # the engine went idle; the rest arrives on the next heartbeat
    assert w.bubble_fractions() == pytest.approx([0.25])


def test_window_clamps_to_unit_interval_and_resets_on_another_pipeline():
    w = BubbleWindow(10.0)
    w.add([0.0], active_s=0.0)
    w.add([3.0], active_s=2.0)  # busy ahead of the engine's clock (reports are not atomic)
    assert w.bubble_fractions() == [0.0]
    w.add([0.0, 0.0], active_s=3.0)
    assert w.bubble_fractions() is None
    with pytest.raises(ValueError):
        BubbleWindow(0.0)


def test_busy_timer_sums_without_keeping_spans():
    t = BusyTimer(torch.device("cpu"), record=False)
    start = time.monotonic()
    for step in range(200):
        t.begin_recv()
        t.begin()
        time.sleep(0.001)
        t.end(step)
    wall = time.monotonic() - start
    assert t.num_steps == 200
    assert 200 * 0.001 <= t.busy_s <= wall
    assert t.spans == [] and t.steps == []  # a long-running server does not grow


def test_busy_timer_record_mode_keeps_the_timeline():
    t = BusyTimer(torch.device("cpu"), record=True)
    for step in range(3):
        t.begin_recv()
        t.begin()
        time.sleep(0.002)
        t.end(step)
    timeline = t.timeline()
    assert [row[0] for row in timeline] == [0, 1, 2]
    assert sum(c - b for _, _, b, c, _ in timeline) == pytest.approx(t.busy_s)
    # queued: when end() was called; on CPU the step's work is done by then
    assert all(b <= c <= queued for _, _, b, c, queued in timeline)
    assert t.summary()["busy_s"] == pytest.approx(t.busy_s)
    host = t.host_summary()
    assert host["eager"]["n"] == 3 and host["graph"]["n"] == 0 and host["eager"]["launch_ms_p50"] >= 2.0
