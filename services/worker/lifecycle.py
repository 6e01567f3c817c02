"""The adapter state machine: one per adapter version a worker serves, as a transition table.

The state says what the version is doing on this worker's *device tier* (the engine's
slots, where requests run): host and disk copies are caches below it and never change the
state (`services.worker.pool`). States:

  UNLOADED        no device slot (a host or disk copy may still be cached)
  LOADING         being fetched, checked and placed in a slot
  LOADED          in a slot and servable: requests are batched with it
  PENDING_SWITCH  no longer servable (switched, rolled back or disabled away): no new
                  requests, in-flight ones finish on it
  SWITCHING       drained: its KV blocks are being invalidated
  SWAPPING_OUT    its slot is being freed and zeroed
  FAILED          its bytes did not match the published digest, or did not validate:
                  never served, never fetched again

Every transition carries exactly one KV action (`KVAction`), which the engine loop
performs when it fires the transition:

  load, loaded, fail, abandon, reactivate, release, swapped_out   none
  switch, rollback, disable     finish in-flight sequences on this version, then
                                invalidate its blocks (the `drained` transition does it)
  drained                       invalidate this version's blocks now
  unload, evict, purge          free now: abort its sequences, free its blocks, so its
                                refcounts reach zero

An illegal transition (say `loaded` on an UNLOADED version, a late fetch result after a
purge) is refused: `AdapterStates.fire` returns None, logs it and counts it, and the state
stays as it was. The table is the whole truth; tests walk every (state, transition) pair.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger("loraplane.worker.lifecycle")


class AdapterState(enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    PENDING_SWITCH = "pending_switch"
    SWITCHING = "switching"
    SWAPPING_OUT = "swapping_out"
    FAILED = "failed"


class Transition(enum.Enum):
    LOAD = "load"
    """Start bringing the version to a device slot (a request, a prefetch, a switch to it)."""
    LOADED = "loaded"
    """Its bytes matched the digest, validated, and sit in a slot."""
    FAIL = "fail"
    """Digest mismatch or invalid adapter: never served."""
    ABANDON = "abandon"
    """The load stopped without a verdict on the bytes (registry unreachable, purge)."""
    SWITCH = "switch"
    ROLLBACK = "rollback"
    DISABLE = "disable"
    """The version stopped being servable, for the reason named."""
    REACTIVATE = "reactivate"
    """Servable again before its in-flight sequences had finished (a quick switch back)."""
    DRAINED = "drained"
    """Its last in-flight sequence finished."""
    RELEASE = "release"
    """Its blocks are invalidated; the slot goes next."""
    UNLOAD = "unload"
    EVICT = "evict"
    """Its slot is taken for another adapter (LRU-K by QoS tier; never a pinned one)."""
    PURGE = "purge"
    """Its tenant is purged."""
    SWAPPED_OUT = "swapped_out"
    """Its slot is free and zeroed."""


class KVAction(enum.Enum):
    NONE = "none"
    FINISH_THEN_INVALIDATE = "finish_then_invalidate"
    INVALIDATE = "invalidate"
    FREE_NOW = "free_now"


S, T, K = AdapterState, Transition, KVAction

KV_ACTION: dict[Transition, KVAction] = {
    T.LOAD: K.NONE,
    T.LOADED: K.NONE,
    T.FAIL: K.NONE,
    T.ABANDON: K.NONE,
    T.SWITCH: K.FINISH_THEN_INVALIDATE,
    T.ROLLBACK: K.FINISH_THEN_INVALIDATE,
    T.DISABLE: K.FINISH_THEN_INVALIDATE,
    T.REACTIVATE: K.NONE,
    T.DRAINED: K.INVALIDATE,
    T.RELEASE: K.NONE,
    T.UNLOAD: K.FREE_NOW,
    T.EVICT: K.FREE_NOW,
    T.PURGE: K.FREE_NOW,
    T.SWAPPED_OUT: K.NONE,
}
"""The one KV action of each transition."""

TABLE: dict[tuple[AdapterState, Transition], AdapterState] = {
    (S.UNLOADED, T.LOAD): S.LOADING,
    (S.LOADING, T.LOADED): S.LOADED,
    (S.LOADING, T.FAIL): S.FAILED,
    (S.LOADING, T.ABANDON): S.UNLOADED,
    (S.LOADING, T.PURGE): S.UNLOADED,
    (S.LOADED, T.SWITCH): S.PENDING_SWITCH,
    (S.LOADED, T.ROLLBACK): S.PENDING_SWITCH,
    (S.LOADED, T.DISABLE): S.PENDING_SWITCH,
    (S.PENDING_SWITCH, T.REACTIVATE): S.LOADED,
    (S.PENDING_SWITCH, T.DRAINED): S.SWITCHING,
    (S.SWITCHING, T.RELEASE): S.SWAPPING_OUT,
    (S.LOADED, T.UNLOAD): S.SWAPPING_OUT,
    (S.LOADED, T.EVICT): S.SWAPPING_OUT,
    (S.LOADED, T.PURGE): S.SWAPPING_OUT,
    (S.PENDING_SWITCH, T.UNLOAD): S.SWAPPING_OUT,
    (S.PENDING_SWITCH, T.PURGE): S.SWAPPING_OUT,
    (S.SWAPPING_OUT, T.SWAPPED_OUT): S.UNLOADED,
}
"""(state, transition) -> next state. Anything not listed is illegal."""

SERVING = frozenset({S.LOADED})
"""States in which new requests may be batched with the version."""
HOLDS_SLOT = frozenset({S.LOADED, S.PENDING_SWITCH, S.SWITCHING, S.SWAPPING_OUT})
"""States in which the version occupies a device slot."""


class IllegalTransition(Exception):
    def __init__(self, state: AdapterState, transition: Transition) -> None:
        super().__init__(f"{transition.value} is not allowed from {state.value}")
        self.state = state
        self.transition = transition


@dataclass(frozen=True)
class Step:
    """A fired transition and the KV action the caller must now perform."""

    key: VersionKey
    before: AdapterState
    transition: Transition
    after: AdapterState

    @property
    def kv_action(self) -> KVAction:
        return KV_ACTION[self.transition]


VersionKey = tuple[str, int]
"""(adapter_id, version)."""


def next_state(state: AdapterState, transition: Transition) -> AdapterState:
    """The table lookup; raises IllegalTransition for a pair the table does not list."""
    try:
        return TABLE[(state, transition)]
    except KeyError:
        raise IllegalTransition(state, transition) from None


class AdapterStates:
    """The state of every adapter version this worker has seen; UNLOADED when absent.

    Owned by the engine loop thread (the only writer); `snapshot` gives other threads a
    copy. `on_illegal` is called with each refused transition (the metrics counter).
    """

    def __init__(self, on_illegal: Callable[[IllegalTransition], None] | None = None) -> None:
        self._states: dict[VersionKey, AdapterState] = {}
        self._on_illegal = on_illegal
        self.illegal = 0

    def get(self, key: VersionKey) -> AdapterState:
        return self._states.get(key, AdapterState.UNLOADED)

    def fire(self, key: VersionKey, transition: Transition) -> Step | None:
        """Apply `transition` to `key` if the table allows it; else refuse, log, count."""
        before = self.get(key)
        try:
            after = next_state(before, transition)
        except IllegalTransition as exc:
            self.illegal += 1
            log.warning("refused illegal transition of %s@%s: %s", key[0], key[1], exc)
            if self._on_illegal is not None:
                self._on_illegal(exc)
            return None
        if after is AdapterState.UNLOADED:
            self._states.pop(key, None)
        else:
            self._states[key] = after
        return Step(key, before, transition, after)

    def restore(self, key: VersionKey, state: AdapterState) -> None:
        """Set a state read back from this worker's own events at start (FAILED only).

        Restart replays to the same states: a version that failed before a crash stays
        failed without fetching its bad bytes again. Loaded versions are not restored
        this way but re-loaded through `load` / `loaded`, so their slot is real.
        """
        if state is not AdapterState.FAILED:
            raise ValueError("only FAILED is restored directly; load the others")
        self._states[key] = state

    def in_state(self, *states: AdapterState) -> list[VersionKey]:
        wanted = set(states)
        return [k for k, s in self._states.items() if s in wanted]

    def snapshot(self) -> dict[VersionKey, AdapterState]:
        return dict(self._states)

    def __iter__(self) -> Iterator[tuple[VersionKey, AdapterState]]:
        return iter(list(self._states.items()))
