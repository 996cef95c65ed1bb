"""Run-time samples wait in memory and are written together (`profiles.PendingSamples`): what a reader sees
is the same as if each had been written at once, and nothing is written twice or lost on the way."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.inprocess.harness import SHOUT_CPU, SHOUT_GPU, Harness
from turnout.models import GpuMode
from turnout.profiles import FOLD_EVERY_S, PendingSamples, Profile, RunSample, fold

samples = st.lists(
    st.builds(
        RunSample,
        st.floats(0.0, 1e4),
        st.none() | st.floats(0.0, 100.0),
        st.none() | st.integers(0, 2**40),
        st.none() | st.integers(0, 2**40),
    ),
    min_size=1,
    max_size=20,
)


@given(stored=samples, waiting=samples)
def test_a_reader_sees_stored_and_waiting_samples_as_if_all_were_written(
    stored: list[RunSample], waiting: list[RunSample]
) -> None:
    # Given a profile written with some samples, and more waiting in memory
    profile = Profile("cap", "cpu", None, **fold(None, stored))
    pending = PendingSamples()
    for s in waiting:
        pending.add(("cap", "cpu", None), s, now=0.0)
    # Then the overlay is the profile all of them make, in order
    [seen] = pending.overlay([profile])
    assert seen == Profile("cap", "cpu", None, **fold(None, [*stored, *waiting]))


def test_samples_of_a_new_profile_show_on_their_own_and_leave_others_alone() -> None:
    other = Profile("other", "gpu", "H100", 3, 2.0)
    pending = PendingSamples()
    pending.add(("cap", "gpu", "H100"), RunSample(1.0), now=0.0)
    assert pending.overlay([other]) == [other, Profile("cap", "gpu", "H100", 1, 1.0)]


def test_samples_are_due_once_the_oldest_waited_and_taken_once() -> None:
    pending = PendingSamples()
    assert not pending.due(100.0) and pending.take() == {}
    pending.add(("cap", "cpu", None), RunSample(1.0), now=10.0)
    pending.add(("cap", "cpu", None), RunSample(2.0), now=10.5)
    assert not pending.due(10.0 + FOLD_EVERY_S / 2)
    assert pending.due(10.0 + FOLD_EVERY_S)
    assert pending.take() == {("cap", "cpu", None): [RunSample(1.0), RunSample(2.0)]}
    assert pending.take() == {} and not pending.due(1e9) and pending.overlay([]) == []


def test_the_controller_shows_a_finished_tasks_sample_at_once_and_writes_it_within_a_second() -> None:
    h = Harness()
    w = h.worker()
    # Given a task that succeeded (run_s 0.5)
    t = h.submit(gpu=GpuMode.NEVER)
    [lease] = h.lease(w)
    assert h.succeed(w, lease) == ([t], [])
    # Then its profile shows at once, though nothing is written yet
    assert [(p.capability, p.samples, p.run_s) for p in h.ctrl.learned_profiles()] == [("shout", 1, 0.5)]
    assert h.store.runs.profiles() == []
    # And the next result after FOLD_EVERY_S writes both samples, once
    h.clock.advance(FOLD_EVERY_S)
    t2 = h.submit(gpu=GpuMode.NEVER)
    [lease2] = h.lease(w)
    assert h.succeed(w, lease2) == ([t2], [])
    assert [(p.capability, p.samples) for p in h.store.runs.profiles()] == [("shout", 2)]
    assert [(p.capability, p.samples) for p in h.ctrl.learned_profiles()] == [("shout", 2)]


def test_auto_routing_writes_the_waiting_samples_before_it_weighs_the_profiles() -> None:
    h = Harness()
    w = h.worker(variants=(SHOUT_CPU, SHOUT_GPU), gpus=1)
    t = h.submit(gpu=GpuMode.NEVER)
    [lease] = h.lease(w)
    assert h.succeed(w, lease) == ([t], [])
    assert h.store.runs.profiles() == []
    # When a task with gpu auto is placed where both device classes could run it
    h.submit(gpu=GpuMode.AUTO)
    h.lease(w)
    # Then the sample was written before auto read the profiles
    assert [(p.device, p.samples) for p in h.store.runs.profiles()] == [("cpu", 1)]
