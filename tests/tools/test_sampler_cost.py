"""tools/sampler_cost.py on a tiny vocabulary: one timing per option and batch size."""

from tools.sampler_cost import OPTIONS, main


def test_prints_every_option_at_every_batch_size(capsys):
    main(["--batch-sizes", "1", "3", "--vocab-size", "300", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["ms/step", "N=1", "N=3"]
    rows = {name: times for name, *times in (line.rsplit(maxsplit=2) for line in lines[2:])}
    assert list(rows) == list(OPTIONS)
    for times in rows.values():
        assert len(times) == 2 and all(float(t) > 0 for t in times)
