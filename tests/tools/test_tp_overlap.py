"""tools/tp_overlap.py on the CPU: the two-halves schedule computes what the serial one does
(the GPU timing is the probe's point; here only its arithmetic and its table)."""

from __future__ import annotations

from tools import tp_overlap


def test_halves_compute_what_serial_does(capsys):
    rows = tp_overlap.main(["--device", "cpu", "--shape", "check", "--tokens", "16", "7", "--layers", "3"])
    assert set(rows) == {16, 7}  # an odd count: halves of 3 and 4 rows
    # float32; a GEMM over other row counts may block its sums differently: not bit for bit
    assert all(r["max_err"] < 1e-4 for r in rows.values()), rows
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "check layer shards at tp=1, cpu, sums: none (one rank)"
    assert out[3].startswith("| 16 | - | - | - | - | ")
