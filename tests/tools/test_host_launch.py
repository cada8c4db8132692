"""launch/host_launch on CPU: the tiny model's three micro-batches are timed and profiled."""

import re

import pytest

from tools import host_launch


def test_host_launch_times_every_micro_batch_and_profiles(tiny_model, capsys):
    host_launch.main(["--model", tiny_model, "--reps", "2", "--profile", "5", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "kernels torch" in out and "2 layers of hidden 64" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and " ms" not in line]
    assert [r.split(" | ")[0][2:] for r in rows] == list(host_launch.CASES)  # no graphs on CPU
    for row in rows:
        assert row.split(" | ")[1] == "eager"
        prepare, launch, device, ratio = (float(re.sub(r" \(.*\)", "", c)) for c in row.strip("| ").split(" | ")[2:])
        # on CPU the forward runs in the call: the launch is the device time
        assert prepare > 0 and launch == pytest.approx(device) and ratio == pytest.approx(1.0)
        assert "waited" not in row
    assert "tottime" in out and "function calls" in out  # cProfile's table


def test_host_launch_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        host_launch.main(["--model", "x", "--reps", "0"])
