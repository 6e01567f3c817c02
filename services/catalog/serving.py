"""Which adapter version serves a request: the one rule the router and every worker apply.

A request names an adapter either by reference (an alias, or an adapter id meaning its
active version) or pinned (`adapter_id@version`). The router resolves references and
sends workers the pinned result; a worker without a router resolves them itself. Both
call `resolve` on their own fold of the same log, so they agree.

Canary assignment is deterministic and sticky: a user's point in [0, 10000) is a hash
of the alias, the tenant and the user id; split entries are laid out on that line newest
version first, each taking `weight`% of it. So while a split stays the same, a user
keeps their version, and moving weight from an older to a newer version (5 → 25) only
moves users toward the newer one. A user whose entry cannot be served (disabled, rolled
back) takes the next servable entry in the same order; nobody else moves.

A version the release rule refuses (`services.catalog.release_rule`: a quality gate not
passed, a canary rollback) is never chosen, like a disabled one.

A version of a purged tenant published before the purge (`AdapterVersion.purged_by`, folded
in `services.catalog.state`) is gone: `purged_reason` refuses it here, so the router's
decision, a worker's on-demand loads, its prefetches and pre-warming, quality gates and
merged mode all refuse it, and `erased_blob_reason` keeps the registry's blob route from
handing out its files.

Refusals use `Refusal.kind`: `not_found` (no such adapter, alias or version, or a version
erased by a purge), `forbidden` (it belongs to another tenant: never served, whatever the
version), and `precondition` (exists but may not be served now: disabled, rolled back,
not active or in a split, built for another base model). Every front answers `forbidden`
exactly as `not_found` (`Refusal.public`), so a caller cannot tell another tenant's name
from a missing one; the real reason stays in the refusal's `message` for the audit.
Another tenant's alias is passed over as if it did not exist (the name is then looked up
as an adapter id, as a missing alias's would be).

Merged mode (`serve worker --merge`) has its rule here too, `merge_target`: which version
a worker dedicated to one adapter serves merged into its base weights. The worker and
the router both apply it, so the router sends that adapter's requests to the worker the
moment its own fold says the worker serves them, without waiting for a heartbeat.
"""

from __future__ import annotations

import hashlib
import re
import struct
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.catalog.release_rule import release_refusal
from services.catalog.state import (
    Adapter,
    AdapterVersion,
    CatalogState,
    Refusal,
    RefusalKind,
    foreign,
)
from services.contracts.events import MERGE_PATTERN, SplitEntry, TenantRef

POINTS = 10_000
"""Resolution of the assignment line: weights are whole percents, so 100 points each."""


@dataclass(frozen=True)
class ServingChoice:
    """The adapter version a request is served with, and what a worker needs to load it."""

    adapter_id: str
    version: int
    sha256: str
    config_sha256: str
    qos_tier: str
    tenant: TenantRef | None
    alias: str | None = None
    """The alias the choice came from, when it came from one."""
    base_model_digest: str | None = field(default=None, compare=False)
    """The base model the version was built for (None where the maker did not say)."""

    @property
    def pinned(self) -> str:
        return f"{self.adapter_id}@{self.version}"


def user_point(scope: str, tenant: TenantRef, user_id: str) -> int:
    """A user's fixed place on the assignment line of `scope` (an alias or adapter id)."""
    return _point(line_prefix(scope, tenant), user_id)


def line_prefix(scope: str, tenant: TenantRef) -> bytes:
    """What every user's point on one line is hashed after: the same for all its users, so
    a `Resolution` keeps it instead of spelling it on every request."""
    return f"{scope}\x1f{tenant.key}\x1f".encode()


_FIRST_8_BYTES = struct.Struct(">Q").unpack_from
"""The digest's first 8 bytes as a big-endian unsigned integer, without slicing a copy."""


def _point(prefix: bytes, user_id: str) -> int:
    return _FIRST_8_BYTES(hashlib.sha256(prefix + user_id.encode()).digest())[0] % POINTS


def split_order(split: Sequence[SplitEntry]) -> list[SplitEntry]:
    """Entries as laid out on the line: newest version first (ties by adapter id)."""
    return sorted(split, key=lambda e: (-e.version, e.adapter_id))


def line_edges(ordered: Sequence[SplitEntry]) -> tuple[int, ...]:
    """The upper edge of each entry's stretch of the line (entries in `split_order`)."""
    edges, edge = [], 0
    for entry in ordered:
        edge += entry.weight * (POINTS // 100)
        edges.append(edge)
    return tuple(edges)


def _entry_index(edges: Sequence[int], point: int) -> int:
    # Weights sum to 100, so a point past the last edge comes only from rounding: the last.
    return min(bisect_right(edges, point), len(edges) - 1)


def entry_at(split: Sequence[SplitEntry], point: int) -> int:
    """Index (in `split_order`) of the entry whose stretch of the line holds `point`."""
    return _entry_index(line_edges(split_order(split)), point)


def purged_reason(adapter: Adapter, number: int, version: AdapterVersion) -> str | None:
    """Why this version is gone for good (its tenant was purged after it was published), or
    None. Whoever asks (a request, a load, a prefetch, a gate, a blob download), the answer
    is no: a purge is what a user means by "the adapters are gone"."""
    if version.purged_by is None:
        return None
    return (f"{adapter.adapter_id}@{number} no longer exists: its tenant was purged (purge "
            f"{version.purged_by}) after it was published; publish it again to serve it")


def unservable(adapter: Adapter, number: int, version: AdapterVersion) -> Refusal | None:
    """`unservable_reason` with the refusal's kind: a purged version is `not_found` (it is
    gone), any other reason `precondition` (it exists, but may not be served now)."""
    gone = purged_reason(adapter, number, version)
    if gone:
        return Refusal("not_found", gone)
    if version.disabled:
        reason = f": {version.disabled_reason}" if version.disabled_reason else ""
        return Refusal("precondition", f"{adapter.adapter_id}@{number} is disabled{reason}")
    if version.rolled_back:
        return Refusal("precondition", f"{adapter.adapter_id}@{number} was rolled back")
    held = release_refusal(adapter, number, version)
    return Refusal("precondition", held) if held else None


def unservable_reason(adapter: Adapter, number: int, version: AdapterVersion) -> str | None:
    """Why this version may never be served now, whichever way it was asked for."""
    refusal = unservable(adapter, number, version)
    return refusal.message if refusal is not None else None


def erased_blob_reason(state: CatalogState, digest: str) -> str | None:
    """Why the blob store must not hand out this blob: every version that references it
    is purged. A blob that a live version also references (the same bytes published by
    another tenant, or by this one after its purge) is handed out, and so is one no
    version references (a regression set, an upload whose publish has not committed)."""
    gone = None
    for adapter in state.adapters.values():
        for number, version in adapter.versions.items():
            if digest not in version.digests():
                continue
            reason = purged_reason(adapter, number, version)
            if reason is None:
                return None
            gone = gone or reason
    return None if gone is None else f"blob {digest} was erased: {gone}"


def _choice(adapter: Adapter, number: int, alias: str | None) -> ServingChoice:
    p = adapter.versions[number].published
    return ServingChoice(adapter.adapter_id, number, p.sha256, p.config_sha256, p.qos_tier,
                         adapter.tenant, alias, p.base_model_digest)


def _owned(state: CatalogState, adapter_id: str, tenant: TenantRef) -> Adapter:
    adapter = state.adapter(adapter_id)  # not_found
    if adapter.tenant is not None and adapter.tenant != tenant:
        raise foreign("adapter", adapter_id, adapter.tenant)
    return adapter


def _check_base(choice: ServingChoice, version: AdapterVersion, base_digest: str | None) -> None:
    if base_digest is not None and version.published.base_model_digest != base_digest:
        raise Refusal("precondition", f"{choice.pinned} was built for base model "
                                      f"{version.published.base_model!r}, not this one")


def in_live_split(state: CatalogState, adapter_id: str, number: int) -> bool:
    """Does some alias currently send traffic (weight > 0) to this version?"""
    return any(e.adapter_id == adapter_id and e.version == number and e.weight > 0
               for alias in state.aliases.values() for e in alias.split)


def resolve_pinned(state: CatalogState, tenant: TenantRef, adapter_id: str, number: int, *,
                   base_digest: str | None = None) -> ServingChoice:
    """`adapter_id@version`: served only if it is the active version or in a live split."""
    adapter = _owned(state, adapter_id, tenant)
    version = adapter.versions.get(number)
    if version is None:
        raise Refusal("not_found", f"adapter {adapter_id!r} has no version {number}")
    refusal = unservable(adapter, number, version)
    if refusal is not None:
        raise refusal
    if adapter.active_version != number and not in_live_split(state, adapter_id, number):
        raise Refusal("precondition", f"{adapter_id}@{number} is neither the active version "
                                      "nor in a traffic split")
    choice = _choice(adapter, number, None)
    _check_base(choice, version, base_digest)
    return choice


def resolve_reference(state: CatalogState, tenant: TenantRef, name: str, user_id: str, *,
                      base_digest: str | None = None) -> ServingChoice:
    """An alias by its split (sticky per user), else an adapter id by its active version."""
    return resolution(state, tenant, name, base_digest=base_digest).pick(user_id)


@dataclass(frozen=True)
class Resolution:
    """`resolve_reference`'s answer for one tenant, name and base model, before the user is
    known: the alias's assignment line (`edges`, upper edge of each entry's stretch, in
    `split_order`) and, for each entry a user's point may fall on, the outcome of the walk
    from there (a choice, or the refusal to raise). A name that is not an alias has no
    line and one outcome. Built from the state once; `pick` is a hash and a bisect."""

    scope: str
    tenant: TenantRef
    edges: tuple[int, ...]
    outcomes: tuple[ServingChoice | Refusal, ...]
    prefix: bytes = field(init=False, repr=False, compare=False)
    """`line_prefix(scope, tenant)`, spelled once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", line_prefix(self.scope, self.tenant))

    def entry(self, user_id: str) -> int:
        """Index in `outcomes` of the user's outcome (0 where there is no line)."""
        if not self.edges:
            return 0
        return _entry_index(self.edges, _point(self.prefix, user_id))

    def pick(self, user_id: str) -> ServingChoice:
        outcome = self.outcomes[self.entry(user_id)]
        if isinstance(outcome, Refusal):  # a new exception each time: no traceback grows
            raise outcome.again()
        return outcome


def resolution(state: CatalogState, tenant: TenantRef, name: str, *,
               base_digest: str | None = None) -> Resolution:
    """The serving rule for references (see the module doc), for every user at once."""
    alias = state.aliases.get(name)
    theirs = alias is not None and alias.tenant is not None and alias.tenant != tenant
    if alias is None or theirs:
        try:
            outcome: ServingChoice | Refusal = _active_choice(state, tenant, name, base_digest)
        except Refusal as refusal:
            outcome = refusal
            if theirs and refusal.kind == "not_found":  # answered alike; the audit knows
                outcome = foreign("alias", name, alias.tenant if alias else None,
                                  answer=refusal.answer)
        return Resolution(name, tenant, (), (outcome,))
    assert alias is not None
    ordered = split_order(alias.split)
    outcomes = []
    for start in range(max(1, len(ordered))):  # an empty split: one refusal for everyone
        try:
            outcomes.append(_walk(state, name, ordered, start, base_digest))
        except Refusal as refusal:
            outcomes.append(refusal)
    return Resolution(name, tenant, line_edges(ordered), tuple(outcomes))


def _active_choice(state: CatalogState, tenant: TenantRef, name: str,
                   base_digest: str | None) -> ServingChoice:
    adapter = _owned(state, name, tenant)
    number = adapter.active_version
    if number is None or number not in adapter.versions:
        raise Refusal("precondition", f"adapter {name!r} has no active version")
    version = adapter.versions[number]
    refusal = unservable(adapter, number, version)
    if refusal is not None:
        raise refusal
    choice = _choice(adapter, number, None)
    _check_base(choice, version, base_digest)
    return choice


def _walk(state: CatalogState, name: str, ordered: Sequence[SplitEntry], start: int,
          base_digest: str | None) -> ServingChoice:
    """From a user's entry along the line: the first servable entry serves the user. An
    alias whose every entry was purged is `not_found` like its versions."""
    reasons: list[str] = []
    kinds: set[RefusalKind] = set()
    for step in range(len(ordered)):
        entry = ordered[(start + step) % len(ordered)]
        if entry.weight == 0:
            continue
        adapter = state.adapters.get(entry.adapter_id)
        version = adapter.versions.get(entry.version) if adapter else None
        if adapter is None or version is None:
            reasons.append(f"{entry.adapter_id}@{entry.version} does not exist")
            kinds.add("precondition")
            continue
        refusal = unservable(adapter, entry.version, version)
        if refusal is not None:
            reasons.append(refusal.message)
            kinds.add(refusal.kind)
            continue
        choice = _choice(adapter, entry.version, name)
        _check_base(choice, version, base_digest)
        return choice
    kind: RefusalKind = "not_found" if kinds == {"not_found"} else "precondition"
    raise Refusal(kind, f"alias {name!r} has no servable version ({'; '.join(reasons)})")


class ResolutionCache:
    """`resolve_reference` and `resolve_pinned` on one fold, memoised: the same tenants ask
    for the same names again and again, and the rule walks adapters, versions, splits and
    the release rule each time. Exact, not approximate: everything is forgotten as soon as
    the fold's `serving_generation` moves (any event that can change an answer), and an
    alias's answer is kept for every user at once (`Resolution`), so a user's sticky
    canary choice is the rule's own. Sees changes made through `CatalogState.apply`."""

    def __init__(self, state: CatalogState, *, max_entries: int = 100_000) -> None:
        self.state = state
        self.max_entries = max_entries
        self._generation = state.serving_generation
        self._references: dict[tuple[str, str, str, str, str | None], Resolution] = {}
        self._pins: dict[tuple[str, str, str, str, int, str | None],
                         ServingChoice | Refusal] = {}

    def _current(self) -> None:
        if self.state.serving_generation != self._generation:
            self._references.clear()
            self._pins.clear()
            self._generation = self.state.serving_generation

    def reference(self, tenant: TenantRef, name: str, user_id: str, *,
                  base_digest: str | None = None) -> ServingChoice:
        """`resolve_reference(state, tenant, name, user_id, base_digest=...)`."""
        return self.resolution(tenant, name, base_digest=base_digest).pick(user_id)

    def resolution(self, tenant: TenantRef, name: str, *,
                   base_digest: str | None = None) -> Resolution:
        """`resolution(state, tenant, name, base_digest=...)`: every user's answer at once,
        valid while the fold's `serving_generation` stays where it is."""
        if self.state.serving_generation != self._generation:
            self._current()
        key = (tenant.org, tenant.team, tenant.project, name, base_digest)
        found = self._references.get(key)
        if found is None:
            if len(self._references) >= self.max_entries:
                self._references.clear()
            found = self._references[key] = resolution(self.state, tenant, name,
                                                       base_digest=base_digest)
        return found

    def pinned(self, tenant: TenantRef, adapter_id: str, number: int, *,
               base_digest: str | None = None) -> ServingChoice:
        """`resolve_pinned(state, tenant, adapter_id, number, base_digest=...)`."""
        if self.state.serving_generation != self._generation:
            self._current()
        key = (tenant.org, tenant.team, tenant.project, adapter_id, number, base_digest)
        found = self._pins.get(key)
        if found is None:
            if len(self._pins) >= self.max_entries:
                self._pins.clear()
            try:
                found = resolve_pinned(self.state, tenant, adapter_id, number,
                                       base_digest=base_digest)
            except Refusal as refusal:
                found = refusal
            self._pins[key] = found
        if isinstance(found, Refusal):
            raise found.again()
        return found


@dataclass(frozen=True)
class MergeSpec:
    """What a worker in merged mode was started for: an adapter, and the version it pins
    (None: the adapter's active version, followed through switches and rollbacks)."""

    adapter_id: str
    version: int | None = None

    @classmethod
    def parse(cls, text: str) -> MergeSpec:
        """`ADAPTER_ID` or `ADAPTER_ID@VERSION`; raises ValueError saying what is wrong."""
        if not re.match(MERGE_PATTERN, text):
            raise ValueError(f"{text!r}: give ADAPTER_ID or ADAPTER_ID@VERSION (an adapter id "
                             "of lowercase letters, digits, '.', '_', '-'; a version >= 1)")
        adapter_id, _, version = text.partition("@")
        return cls(adapter_id, int(version) if version else None)

    def __str__(self) -> str:
        return self.adapter_id if self.version is None else f"{self.adapter_id}@{self.version}"


def merge_target(state: CatalogState, spec: MergeSpec, *,
                 base_digest: str | None = None) -> ServingChoice:
    """The version a worker in merged mode serves now, as its own tenant would be served
    it: the pinned version while `resolve_pinned` allows it, else the active version.
    Raises Refusal saying why none may be (no such adapter yet, no active version,
    disabled, rolled back away from, switched away from a pinned version, gated, built
    for another base model, its tenant purged since it was published); the worker then
    holds nothing merged. A purge ends merged serving as it ends every other kind (the
    purge rule of `unservable`); a version published after the purge is served."""
    adapter = state.adapter(spec.adapter_id)
    number = spec.version if spec.version is not None else adapter.active_version
    if number is None:
        raise Refusal("precondition", f"adapter {spec.adapter_id!r} has no active version")
    return resolve_as_owner(state, spec.adapter_id, number, base_digest=base_digest)


def resolve_as_owner(state: CatalogState, adapter_id: str, number: int, *,
                     base_digest: str | None = None) -> ServingChoice:
    """`resolve_pinned` for the adapter's own tenant: may this version be served at all
    now? (What a worker asks of a version it holds, whoever's request comes next.)"""
    adapter = state.adapter(adapter_id)
    owner = adapter.tenant or TenantRef(org="unknown", team="unknown", project="unknown")
    return resolve_pinned(state, owner, adapter_id, number, base_digest=base_digest)
