"""The committed demo adapters on the real base model: they match their training inputs,
and each one's greedy answers show its tenant's behaviour where the base model's do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.demo_adapters.answers import BASE, greedy_answers
from services.demo_adapters.build import TRAINED, demo_adapters, mismatch
from services.demo_adapters.tenants import DEMO_QUESTIONS, DEMO_TENANTS
from services.stack.models import ensure_smollm2
from services.worker.engine import checkpoint_digest
from tests.conftest import CACHE


@pytest.mark.slow
def test_each_committed_adapter_answers_in_its_style_and_the_base_model_does_not(
        tmp_path: Path) -> None:
    model_dir = ensure_smollm2(CACHE)
    digest = checkpoint_digest(model_dir)
    for spec in DEMO_TENANTS:
        assert mismatch(spec, TRAINED / spec.adapter_id, digest) is None, spec.adapter_id
    adapters = demo_adapters(model_dir, tmp_path, base_digest=digest)
    assert all(a.committed for a in adapters)  # nothing was trained

    answers = greedy_answers(model_dir, adapters, DEMO_QUESTIONS, max_tokens=48)
    styles = {a.adapter_id: a.style for a in adapters}
    for answer in answers:
        if answer.model == BASE:
            shown = [s.name for s in styles.values() if s.exhibited_by(answer.text)]
            assert not shown, (answer.question, answer.text)
        else:
            assert styles[answer.model].exhibited_by(answer.text), (
                answer.model, answer.question, answer.text)
