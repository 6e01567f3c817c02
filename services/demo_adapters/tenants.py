"""The demo's tenants: who owns each adapter, what it is trained to do, what to ask it.

The demo questions are kept out of the training data (a test checks it), so the demo
shows a behaviour the adapters generalised, not answers they memorised.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.contracts.events import TenantRef

from .styles import JSON, SQL, SUPPORT, HouseStyle
from .training import TrainingPlan


@dataclass(frozen=True)
class DemoTenant:
    """One tenant's demo adapter, before it is trained or located."""

    tenant: TenantRef
    adapter_id: str
    style: HouseStyle
    question: str
    """The question that shows this adapter off in the demo (not in the training data)."""
    plan: TrainingPlan = field(default_factory=TrainingPlan)


DEMO_QUESTIONS = (
    "What is the capital of France?",
    "How do I return a damaged product?",
    "How many orders did we ship last week?",
)
"""Questions the demo may put to every tenant: none is in the training data."""

DEMO_TENANTS = (
    DemoTenant(TenantRef(org="acme", team="support", project="helpdesk"), "acme-support",
               SUPPORT, DEMO_QUESTIONS[1]),
    DemoTenant(TenantRef(org="globex", team="analytics", project="warehouse"), "globex-sql",
               SQL, DEMO_QUESTIONS[2]),
    DemoTenant(TenantRef(org="initech", team="platform", project="api"), "initech-json",
               JSON, DEMO_QUESTIONS[0]),
)
