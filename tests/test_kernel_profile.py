"""The kernel profile's critical-path attribution (``core/benchmarks/kernel_profile.py``)."""

from engine.benchmarks.kernel_profile import critical_path


def test_overlapping_kernels_are_charged_only_for_the_time_they_add():
    # a: 0-10; b starts early (programmatic dependent launch) at 8 and waits until 10, ends at
    # 14; a 3 us launch gap; c: 17-20; a long host gap; d: 100-104.
    events = [
        ("a", 10.0, 0.0, 10.0),
        ("c", 3.0, 17.0, 20.0),
        ("b", 6.0, 8.0, 14.0),
        ("d", 4.0, 100.0, 104.0),
    ]
    path, launch_idle, host_idle = critical_path(events, gap_split_us=20.0)
    assert path == {"a": 10.0, "b": 4.0, "c": 3.0, "d": 4.0}
    assert launch_idle == 3.0
    assert host_idle == 80.0
    # Path plus idle covers the whole span from the first start to the last end.
    assert sum(path.values()) + launch_idle + host_idle == 104.0


def test_a_kernel_hidden_under_a_longer_one_adds_nothing():
    events = [("long", 50.0, 0.0, 50.0), ("inside", 5.0, 10.0, 15.0), ("after", 5.0, 50.0, 55.0)]
    path, launch_idle, host_idle = critical_path(events, gap_split_us=20.0)
    assert path == {"long": 50.0, "inside": 0.0, "after": 5.0}
    assert launch_idle == host_idle == 0.0
