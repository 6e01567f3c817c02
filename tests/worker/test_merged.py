"""Merged mode in the engine loop, on a real engine and real tiers, fed folded events: the
version it merges follows the log (switch, disable, enable, purge), its tokens are the
unmerged adapter's, and everything else is refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.contracts.events import (
    AdapterDisabled,
    AdapterEnabled,
    TenantPurged,
    TenantPurgeRequested,
)
from services.worker.engine import AdapterDigest
from services.worker.engine.request import TokenEvent
from services.worker.engine_loop import Finished, Refused
from tests.waiting import wait_for
from tests.worker.conftest import ServedModel
from tests.worker.rig import ACME, Rig, make_rig

SEEDS = {1: 71, 2: 72}
"""bot's versions → the seed of their weights (the same bytes in every rig)."""


def greedy(rig: Rig, adapter_id: str | None, timeout_s: float = 60.0
           ) -> tuple[list[int], Finished | Refused]:
    ticket = rig.ask(adapter_id, max_tokens=6)
    tokens: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        output = ticket.sink.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(output, TokenEvent) and output.token_id is not None:
            tokens.append(output.token_id)
        if isinstance(output, Finished | Refused):
            return tokens, output


def refused(rig: Rig, adapter_id: str | None) -> Refused:
    _, out = greedy(rig, adapter_id)
    assert isinstance(out, Refused), out
    return out


def merged(rig: Rig) -> AdapterDigest | None:
    return rig.call(lambda: rig.engine.merged_adapter)  # type: ignore[no-any-return]


def test_merged_mode_follows_the_log(served_model: ServedModel, tmp_path: Path) -> None:
    unmerged: dict[int, list[int]] = {}
    with make_rig(served_model, tmp_path / "general") as general:
        for version, seed in SEEDS.items():
            general.publish("bot", version, seed)
            general.switch("bot", version)
            tokens, out = greedy(general, "bot")
            assert isinstance(out, Finished) and out.choice and out.choice.version == version
            unmerged[version] = tokens
    assert unmerged[1] != unmerged[2]

    with make_rig(served_model, tmp_path / "merged", worker_merge="bot") as rig:
        assert refused(rig, "bot").code == "NOT_FOUND"  # not published yet
        v1 = rig.publish("bot", 1, SEEDS[1])
        v2 = rig.publish("bot", 2, SEEDS[2])
        rig.publish("other", 1, 73)
        rig.switch("other", 1)
        rig.switch("bot", 1)
        tokens, out = greedy(rig, "bot")
        assert isinstance(out, Finished), out
        assert tokens == unmerged[1]  # merged: the unmerged adapter's greedy tokens
        assert out.choice is not None and (out.choice.version, out.choice.sha256) == (
            1, v1.sha256)  # what FinalUsage and RequestServed name
        assert merged(rig) == AdapterDigest(v1.sha256, v1.config_sha256)
        beat = rig.loop.heartbeat()
        assert beat is not None and beat.merged_mode is not None
        assert (beat.merged_mode.adapter_id, beat.merged_mode.pinned_version,
                beat.merged_mode.version, beat.merged_mode.sha256) == ("bot", None, 1, v1.sha256)

        other = refused(rig, "other")
        assert other.code == "FAILED_PRECONDITION" and "only adapter bot" in other.message
        assert "other@1 is served by other workers" in other.message
        base = refused(rig, None)
        assert base.code == "FAILED_PRECONDITION" and "base model" in base.message

        rig.switch("bot", 2)  # re-merges from the pristine base
        tokens, out = greedy(rig, "bot")
        assert isinstance(out, Finished) and tokens == unmerged[2], out
        assert out.choice is not None and out.choice.sha256 == v2.sha256
        assert merged(rig) == AdapterDigest(v2.sha256, v2.config_sha256)

        rig.fold(AdapterDisabled(adapter_id="bot", version=2, reason="bad"), "adapter/bot", ACME)
        wait_for(lambda: merged(rig) is None, 20)  # unmerged: the base weights are back
        gone = refused(rig, "bot")
        assert gone.code == "FAILED_PRECONDITION" and "disabled" in gone.message
        beat = rig.loop.heartbeat()
        assert beat is not None and beat.merged_mode is not None
        assert beat.merged_mode.version is None and beat.merged_mode.sha256 is None

        rig.fold(AdapterEnabled(adapter_id="bot", version=2), "adapter/bot", ACME)
        tokens, out = greedy(rig, "bot")
        assert isinstance(out, Finished) and tokens == unmerged[2], out

        rig.fold(TenantPurgeRequested(purge_id="p-merged", deadline_s=60, hard=True,
                                      expected_workers=["w-test"]), "tenant/acme/t/p", ACME)
        wait_for(lambda: rig.events.of(TenantPurged), 20)
        ack = rig.events.of(TenantPurged)[0]
        assert ack.purge_id == "p-merged" and ack.adapters_unloaded >= 1
        assert merged(rig) is None  # the purged tenant's delta left the base weights
        purged = refused(rig, "bot")  # and is never fetched back: gone, as everywhere
        assert purged.code == "NOT_FOUND" and "purge p-merged" in purged.message


def test_a_pinned_version_is_unmerged_once_switched_away_from(
        served_model: ServedModel, tmp_path: Path) -> None:
    with make_rig(served_model, tmp_path, worker_merge="bot@1") as rig:
        v1 = rig.publish("bot", 1, SEEDS[1])
        rig.publish("bot", 2, SEEDS[2])
        rig.switch("bot", 1)
        _, out = greedy(rig, "bot")
        assert isinstance(out, Finished) and out.choice and out.choice.sha256 == v1.sha256
        rig.switch("bot", 2)
        wait_for(lambda: merged(rig) is None, 20)
        moved = refused(rig, "bot")  # bot@2 now: not the version this worker pins
        assert moved.code == "FAILED_PRECONDITION" and "bot@1" in moved.message


@pytest.mark.parametrize("text", ["Bot", "bot@0", "bot@x"])
def test_a_bad_merge_setting_is_refused_at_startup(text: str) -> None:
    from pydantic import ValidationError

    from services.config import Settings

    with pytest.raises(ValidationError, match="worker_merge"):
        Settings(worker_merge=text)


def test_a_bad_merge_option_is_refused() -> None:
    from typer.testing import CliRunner

    from services.cli import app

    done = CliRunner().invoke(app, ["serve", "worker", "--merge", "Bot@0"])
    assert done.exit_code == 2
    assert "ADAPTER_ID@VERSION" in done.output
