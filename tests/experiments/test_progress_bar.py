"""The experiments' progress bar: moved to a value, never past its total."""

import io
import warnings

from experiments.run_output import _advance, _progress_bar


def test_the_bar_stops_at_its_total_without_a_warning(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    bar = _progress_bar(True, 15.0, "s")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # tqdm warns when a bar passes its total
        for value in (1.2, 14.2, 15.000001, 15.2):
            _advance(bar, value)
    assert bar.n == 15.0
    _advance(bar, 3.0)  # a later value below: the bar follows it
    assert bar.n == 3.0
    bar.close()
    assert _progress_bar(False, 15.0, "s") is None
