"""Tests of the ``ashl_reference`` and ``dylu`` plan schemes and their fields."""

import dataclasses
import json

import pytest

from hpsjax.profiling import (
    ASHL_STAGE_MULTIPLIERS,
    MIN_COMPRESS_RATIO,
    Replanner,
    TransferProfile,
    WorkerProfile,
    WorkPlan,
    plan,
)

W = WorkerProfile.synthetic

NEW_WORKER_FIELDS = (
    "push_seconds",
    "stage_local_steps",
    "data_share",
    "push_weight",
    "compress_ratio",
)
NEW_PLAN_FIELDS = ("stage_multipliers", "base_compress_ratio")


def _worker(worker_id, speed, push, pull):
    """One device of ``speed`` samples per second, a measured push and pull."""
    transfer = TransferProfile(
        round_trip_seconds=push + pull,
        push_seconds=push,
        pull_seconds=pull,
        push_bytes=0,
        pull_bytes=0,
        method="measured",
    )
    return dataclasses.replace(W(worker_id, speed), transfer=transfer)


def _three_workers():
    # one sample each: c_i = 1, 0.5, 0.25 seconds per step
    # T_i = 0.3, 1.0, 2.0 seconds, of which the push is 0.1, 0.8, 1.6
    return [
        _worker(0, 1.0, 0.1, 0.2),
        _worker(1, 2.0, 0.8, 0.2),
        _worker(2, 4.0, 1.6, 0.4),
    ]


def _field(work_plan, name):
    return [getattr(w, name) for w in work_plan.workers]


# --- ashl_reference ----------------------------------------------------------


def test_ashl_reference_by_hand():
    p = plan(_three_workers(), "ashl_reference", global_batch=3, compress_ratio=0.25)
    assert _field(p, "batch_size") == [1, 1, 1]
    assert p.stage_multipliers == ASHL_STAGE_MULTIPLIERS == (8, 2)
    assert p.base_compress_ratio == 0.25
    # AHL, k = 8, m_i = T_i: 8 c_i + T_i = 8.3, 5.0, 4.0, so L = 8.3 and
    # H_i = round((8.3 - T_i) / c_i) = round(8, 14.6, 25.2)
    # SHL, k = 2, m_i = 0.25 P_i + (T_i - P_i) = 0.225, 0.4, 0.8:
    # 2 c_i + m_i = 2.225, 1.4, 1.3, so L = 2.225 and
    # H_i = round((2.225 - m_i) / c_i) = round(2, 3.65, 5.7)
    assert _field(p, "stage_local_steps") == [(8, 2), (15, 4), (25, 6)]
    assert _field(p, "local_steps") == [8, 15, 25]
    assert [w.stage_steps(1) for w in p.workers] == [2, 4, 6]
    # p_i = H_i(2) / 12
    assert _field(p, "data_share") == pytest.approx([1 / 6, 1 / 3, 1 / 2])
    assert sum(_field(p, "data_share")) == pytest.approx(1.0)
    assert _field(p, "push_weight") == _field(p, "data_share")
    # SHL rounds H c + m: 2.225, 2.4, 2.3, so M = 2.4 (worker 1, at 0.25);
    # ratio_i = (M - H_i c_i - (T_i - P_i)) / P_i = 1.75 -> 1, 0.25, 0.3125
    assert _field(p, "compress_ratio") == pytest.approx([1.0, 0.25, 0.3125])
    # the plan's round is the AHL stage's: 8 + 0.3, 7.5 + 1, 6.25 + 2
    assert _field(p, "round_time") == pytest.approx([8.3, 8.5, 8.25])
    assert p.round_time == pytest.approx(8.5)
    assert _field(p, "push_seconds") == [0.1, 0.8, 1.6]
    assert [w.lr_scale for w in p.workers] == [1.0] * 3


def test_ashl_reference_without_compression_and_other_multipliers():
    p = plan(_three_workers(), "ashl_reference", global_batch=3)
    # compress_ratio 1: both stages count the full round trip. SHL:
    # 2 c_i + T_i = 2.3, 2.0, 2.5, L = 2.5, H_i = round(2.2, 3, 2)
    assert _field(p, "stage_local_steps") == [(8, 2), (15, 3), (25, 2)]
    assert _field(p, "data_share") == pytest.approx([2 / 7, 3 / 7, 2 / 7])
    assert _field(p, "compress_ratio") == [1.0, 1.0, 1.0]
    assert p.base_compress_ratio == 1.0
    p = plan(
        _three_workers(), "ashl_reference", global_batch=3, stage_multipliers=[4, 1]
    )
    # k = 4: 4.3, 3.0, 3.0, L = 4.3, H_i = round(4, 6.6, 9.2)
    # k = 1: 1.3, 1.5, 2.25, L = 2.25, H_i = round(1.95, 2.5, 1) (halves up)
    assert _field(p, "stage_local_steps") == [(4, 2), (7, 3), (9, 1)]
    assert p.stage_multipliers == (4, 1)
    p = plan(_three_workers(), "ashl_reference", global_batch=3, max_local_steps=10)
    assert _field(p, "stage_local_steps") == [(8, 2), (10, 3), (10, 2)]


def test_ashl_reference_round_trip_only_counts_half_as_push():
    # only the round trip known: P_i = T_i / 2
    workers = [W(0, 1.0, transfer_seconds=0.4), W(1, 2.0, transfer_seconds=2.0)]
    p = plan(workers, "ashl_reference", global_batch=2, compress_ratio=0.5)
    assert _field(p, "push_seconds") == [None, None]
    # AHL: 8 c + T = 8.4, 6.0, L = 8.4, H_i = round(8, 12.8)
    # SHL: m_i = 0.5 * 0.2 + 0.2 = 0.3, 0.5 * 1 + 1 = 1.5; 2 c + m = 2.3, 2.5
    # L = 2.5, H_i = round(2.2, 2) = 2, 2; rounds 2.3, 2.5, M = 2.5
    # ratio_0 = (2.5 - 2 - 0.2) / 0.2 = 1.5 -> 1; ratio_1 = 0.5
    assert _field(p, "stage_local_steps") == [(8, 2), (13, 2)]
    assert _field(p, "compress_ratio") == pytest.approx([1.0, 0.5])
    # no transfer at all: nothing to compress
    p = plan(
        [W(0, 1.0), W(1, 3.0)], "ashl_reference", global_batch=2, compress_ratio=0.01
    )
    assert _field(p, "compress_ratio") == [1.0, 1.0]
    assert _field(p, "stage_local_steps") == [(8, 2), (24, 6)]


def test_ashl_reference_ratio_has_a_floor():
    # worker 1's push is far longer than worker 0's: at the smallest base
    # ratio it sets the round, and the floor holds
    workers = [_worker(0, 1.0, 0.5, 0.0), _worker(1, 1.0, 100.0, 0.0)]
    p = plan(
        workers,
        "ashl_reference",
        global_batch=2,
        compress_ratio=MIN_COMPRESS_RATIO,
    )
    assert min(_field(p, "compress_ratio")) >= MIN_COMPRESS_RATIO
    assert _field(p, "compress_ratio")[1] == pytest.approx(MIN_COMPRESS_RATIO)


def test_other_schemes_keep_the_defaults():
    for scheme in ("hps", "ashl", "adsp", "equal", "dylu"):
        p = plan(_three_workers(), scheme, global_batch=30, local_steps=2)
        assert p.stage_multipliers == () and p.base_compress_ratio == 1.0
        assert _field(p, "stage_local_steps") == [(), (), ()]
        assert _field(p, "data_share") == [None] * 3
        assert _field(p, "push_weight") == [1.0] * 3
        assert _field(p, "compress_ratio") == [1.0] * 3
        assert [w.stage_steps(3) for w in p.workers] == _field(p, "local_steps")


# --- dylu --------------------------------------------------------------------


def _dylu_workers():
    # batch 6 each: t_i = 6, 3, 2 seconds per step
    return [W(0, 1.0, transfer_seconds=0.5), W(1, 2.0), W(2, 3.0)]


def test_dylu_steps_by_hand():
    p = plan(_dylu_workers(), "dylu", global_batch=18, local_steps=10)
    assert _field(p, "batch_size") == [6, 6, 6]
    # H_i = round(10 * 2 / t_i) = round(3.33, 6.67, 10)
    assert _field(p, "local_steps") == [3, 7, 10]
    assert _field(p, "round_time") == pytest.approx([18.5, 21.0, 20.0])
    # a worker a hundred times slower still runs one step
    p = plan([W(0, 1.0), W(1, 100.0)], "dylu", global_batch=2, local_steps=4)
    assert _field(p, "local_steps") == [1, 4]
    p = plan(
        _dylu_workers(), "dylu", global_batch=18, local_steps=10, max_local_steps=10
    )
    assert _field(p, "local_steps") == [3, 7, 10]


def test_dylu_replans_steps_when_speeds_drift():
    p = plan(_dylu_workers(), "dylu", global_batch=18, local_steps=10)
    replanner = Replanner(p, cooldown=0.0, warmup=0)
    new = None
    # the fastest worker drops to a third of its speed: 6 s per step
    for k in range(3):
        new = replanner.observe(2, 6, 6.0, now=float(k)) or new
    assert new is not None and new.revision == 1
    assert new.scheme == "dylu" and new.local_steps == 10
    assert _field(new, "batch_size") == [6, 6, 6]
    # t_i = 6, 3, 6: worker 1 is now the fastest, H_i = round(10 * 3 / t_i)
    assert _field(new, "local_steps") == [5, 10, 5]


def test_ashl_reference_replans_with_its_settings():
    p = plan(
        _three_workers(),
        "ashl_reference",
        global_batch=3,
        compress_ratio=0.25,
        stage_multipliers=(6, 2),
    )
    replanner = Replanner(p, cooldown=0.0, min_observations=1, window=1, warmup=0)
    # worker 2 at half its speed: c_2 = 0.5, as worker 1
    new = replanner.observe(2, 1, 0.5, now=0.0)
    assert new.stage_multipliers == (6, 2) and new.base_compress_ratio == 0.25
    assert _field(new, "push_seconds") == [0.1, 0.8, 1.6]
    # AHL: 6 c + T = 6.3, 4.0, 5.0, L = 6.3, H = round(6, 10.6, 8.6)
    # SHL: m = 0.225, 0.4, 0.8; 2 c + m = 2.225, 1.4, 1.8,
    # H = round(2, 3.65, 2.85)
    assert _field(new, "stage_local_steps") == [(6, 2), (11, 4), (9, 3)]
    assert sum(_field(new, "data_share")) == pytest.approx(1.0)
    assert _field(new, "data_share") == pytest.approx([2 / 9, 4 / 9, 3 / 9])


# --- JSON --------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["ashl_reference", "dylu"])
def test_json_round_trip_of_the_new_fields(scheme):
    kwargs = {"compress_ratio": 0.25} if scheme == "ashl_reference" else {}
    p = plan(_three_workers(), scheme, global_batch=3, **kwargs)
    text = p.to_json()
    data = json.loads(text)
    assert all(key in data["workers"][0] for key in NEW_WORKER_FIELDS)
    again = WorkPlan.from_json(text)
    assert again == p
    assert isinstance(again.workers[0].stage_local_steps, tuple)
    assert isinstance(again.stage_multipliers, tuple)
    assert WorkPlan.from_json(again.to_json()) == p


@pytest.mark.parametrize("scheme", ["hps", "ashl", "adsp", "equal"])
def test_old_json_without_the_fields_still_loads(scheme):
    p = plan(_three_workers(), scheme, global_batch=30, local_steps=2)
    data = json.loads(p.to_json())
    for key in NEW_PLAN_FIELDS:
        del data[key]
    for w in data["workers"]:
        for key in NEW_WORKER_FIELDS:
            del w[key]
    old = WorkPlan.from_json(json.dumps(data))
    # the old text has no push times; everything else is the same
    assert old == dataclasses.replace(
        p,
        workers=tuple(dataclasses.replace(w, push_seconds=None) for w in p.workers),
    )


# --- bad input ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage_multipliers": (8, 2)}, "apply to 'ashl_reference' only"),
        ({"compress_ratio": 0.5}, "apply to 'ashl_reference' only"),
        ({"scheme": "dylu", "compress_ratio": 0.5}, "apply to 'ashl_reference'"),
        ({"scheme": "ashl_reference", "stage_multipliers": (8,)}, "two ints"),
        ({"scheme": "ashl_reference", "stage_multipliers": "82"}, "two ints"),
        (
            {"scheme": "ashl_reference", "stage_multipliers": (8, 0)},
            "stage_multipliers must be an int >= 1",
        ),
        ({"scheme": "ashl_reference", "compress_ratio": 0.0}, "compress_ratio must"),
        ({"scheme": "ashl_reference", "compress_ratio": 1.5}, "compress_ratio must"),
        ({"scheme": "ashl_reference", "compress_ratio": "1"}, "compress_ratio must"),
        ({"scheme": "dylu", "local_steps": 0}, "local_steps must be an int >= 1"),
    ],
)
def test_bad_plan_arguments(kwargs, message):
    kwargs = {"scheme": "hps", "global_batch": 3, **kwargs}
    with pytest.raises(ValueError, match=message) as info:
        plan(_three_workers(), **kwargs)
    assert "\n" not in str(info.value)


def test_bad_fields():
    p = plan(_three_workers(), "ashl_reference", global_batch=3)
    w = p.workers[0]
    for change, message in [
        ({"data_share": 1.5}, "data_share must be in"),
        ({"push_weight": -1.0}, "push_weight must be"),
        ({"push_weight": float("nan")}, "push_weight must be"),
        ({"compress_ratio": 0.0}, "compress_ratio must be in"),
        ({"stage_local_steps": (0, 1)}, "stage_local_steps must be ints >= 1"),
        ({"stage_local_steps": "ab"}, "stage_local_steps must be a sequence"),
        ({"push_seconds": 5.0}, "push_seconds must be in"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(w, **change)
    for workers, message in [
        ((dataclasses.replace(w, data_share=1.0), *p.workers[1:]), "sum to 1"),
        ((dataclasses.replace(w, data_share=None), *p.workers[1:]), "sum to 1"),
        ((dataclasses.replace(w, stage_local_steps=(1,)), *p.workers[1:]), "length"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(p, workers=workers)
    with pytest.raises(ValueError, match="stage 2 is not one of"):
        w.stage_steps(2)
    with pytest.raises(ValueError, match="stage must be an int"):
        w.stage_steps(True)
    data = json.loads(p.to_json())
    data["workers"][1]["compress_ratio"] = 2.0
    with pytest.raises(ValueError, match="compress_ratio must be in"):
        WorkPlan.from_json(json.dumps(data))


def test_module_doctests():
    import doctest

    import hpsjax.planning
    from hpsjax.planning import _overlap, _plan, _profiles, _replan, _workplan

    names = vars(hpsjax.planning)
    for module in (_overlap, _plan, _profiles, _replan, _workplan):
        results = doctest.testmod(module, extraglobs=names)
        assert results.attempted > 0 and results.failed == 0, module.__name__
