"""The demo tenants' LoRA adapters on SmolLM2-135M-Instruct, and how they were made.

`demo_adapters(base_model_dir, cache_dir)` gives each tenant's adapter directory, owner,
adapter id and a question that shows it off; `python -m services.demo_adapters` checks,
re-trains and compares them.
"""

from .build import DemoAdapter, demo_adapters
from .tenants import DEMO_QUESTIONS, DEMO_TENANTS, DemoTenant

__all__ = ["DEMO_QUESTIONS", "DEMO_TENANTS", "DemoAdapter", "DemoTenant", "demo_adapters"]
