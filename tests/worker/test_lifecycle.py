"""The adapter state machine over its whole table: every (state, transition) pair, and
random walks that must only ever take listed edges."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.worker.lifecycle import (
    HOLDS_SLOT,
    KV_ACTION,
    TABLE,
    AdapterState,
    AdapterStates,
    IllegalTransition,
    KVAction,
    Transition,
    next_state,
)

S, T, K = AdapterState, Transition, KVAction
KEY = ("bot", 1)


@pytest.mark.parametrize(("state", "transition"), list(itertools.product(S, T)))
def test_every_pair_is_applied_or_refused(state: AdapterState, transition: Transition) -> None:
    refused: list[IllegalTransition] = []
    states = AdapterStates(on_illegal=refused.append)
    if state is not S.UNLOADED:
        states._states[KEY] = state  # the starting point under test
    step = states.fire(KEY, transition)
    if (state, transition) in TABLE:
        assert step is not None and step.after is TABLE[(state, transition)]
        assert states.get(KEY) is TABLE[(state, transition)]
        assert step.kv_action is KV_ACTION[transition]
        assert not refused and states.illegal == 0
    else:
        assert step is None, "an illegal transition is never applied"
        assert states.get(KEY) is state
        assert states.illegal == 1 and refused[0].transition is transition
        with pytest.raises(IllegalTransition):
            next_state(state, transition)


def test_the_documented_path_and_its_kv_actions() -> None:
    states = AdapterStates()
    path = [T.LOAD, T.LOADED, T.SWITCH, T.DRAINED, T.RELEASE, T.SWAPPED_OUT]
    actions = [states.fire(KEY, t).kv_action for t in path]  # type: ignore[union-attr]
    assert actions == [K.NONE, K.NONE, K.FINISH_THEN_INVALIDATE, K.INVALIDATE, K.NONE, K.NONE]
    assert states.get(KEY) is S.UNLOADED and KEY not in states.snapshot()


def test_kv_action_per_transition_is_the_issue_s() -> None:
    assert {t for t, a in KV_ACTION.items() if a is K.FINISH_THEN_INVALIDATE} == {
        T.SWITCH, T.ROLLBACK, T.DISABLE}
    assert {t for t, a in KV_ACTION.items() if a is K.FREE_NOW} == {T.UNLOAD, T.EVICT, T.PURGE}
    assert set(KV_ACTION) == set(T)


def test_failed_is_final_and_restored_only_as_failed() -> None:
    assert not [t for (s, t) in TABLE if s is S.FAILED]
    states = AdapterStates()
    states.restore(KEY, S.FAILED)
    assert states.get(KEY) is S.FAILED
    with pytest.raises(ValueError):
        states.restore(("x", 1), S.LOADED)


@given(st.lists(st.sampled_from(list(T)), max_size=60))
def test_random_walks_take_only_listed_edges(walk: list[Transition]) -> None:
    states = AdapterStates()
    state = S.UNLOADED
    for transition in walk:
        step = states.fire(KEY, transition)
        if (state, transition) in TABLE:
            assert step is not None
            state = TABLE[(state, transition)]
        else:
            assert step is None
        assert states.get(KEY) is state
    # whatever happened, a version holding a slot can always be freed
    if state in HOLDS_SLOT - {S.SWITCHING, S.SWAPPING_OUT}:
        assert (state, T.PURGE) in TABLE


def reachable_from(start: AdapterState) -> set[AdapterState]:
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for (s, _), after in TABLE.items():
            if s is here and after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


def test_every_state_is_reachable_and_every_slot_holder_can_leave() -> None:
    assert reachable_from(S.UNLOADED) == set(S)
    for state in HOLDS_SLOT:
        assert S.UNLOADED in reachable_from(state), state
