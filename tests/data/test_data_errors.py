"""A dataset named by registry fails in one line when its arguments are wrong."""

from __future__ import annotations

import numpy as np
import pytest

from hpsjax.data import get_dataset


def test_npz_without_a_path_names_the_argument_in_one_line():
    with pytest.raises(ValueError) as e:
        get_dataset("npz")
    assert str(e.value) == "dataset 'npz' needs path=...: the .npz file to read"


def test_an_argument_the_loader_does_not_take_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        get_dataset("npz", file="a.npz")
    message = str(e.value)
    assert "\n" not in message
    assert "'file'" in message and "path, x_key, y_key, num_classes" in message


def test_npz_with_a_missing_file_or_missing_keys_fails_in_one_line(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        get_dataset("npz", path=str(tmp_path / "missing.npz"))
    assert "\n" not in str(e.value) and "missing.npz" in str(e.value)
    np.savez(tmp_path / "other.npz", images=np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError) as e:
        get_dataset("npz", path=str(tmp_path / "other.npz"))
    assert str(e.value).endswith("has no array 'x'; it holds ['images']")


def test_npz_with_its_path_loads(tmp_path):
    # The call hpsjax-worker's --dataset npz --dataset_arg path=FILE makes.
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    np.savez(tmp_path / "mine.npz", x=x, y=np.array([0, 1, 2, 0, 1, 2]))
    dataset = get_dataset("npz", path=str(tmp_path / "mine.npz"))
    assert len(dataset) == 6 and dataset.num_classes == 3
    np.testing.assert_array_equal(dataset.x, x)
