"""QoS tier names (the events' spelling) and the proto's `loraplane.v1.QosTier` values.

The router and the worker service both translate between the two; one table, here.
"""

from __future__ import annotations

from services.contracts.grpc import inference_pb2 as pb

TIER_TO_PROTO: dict[str, int] = {
    "platinum": pb.QOS_TIER_PLATINUM,
    "gold": pb.QOS_TIER_GOLD,
    "silver": pb.QOS_TIER_SILVER,
    "bronze": pb.QOS_TIER_BRONZE,
}
PROTO_TO_TIER: dict[int, str] = {v: k for k, v in TIER_TO_PROTO.items()}
TIER_ORDER: tuple[str, ...] = ("platinum", "gold", "silver", "bronze")
"""Best first."""


def tier_of(value: int) -> str | None:
    """The tier name of a proto value; None for QOS_TIER_UNSPECIFIED (or unknown)."""
    return PROTO_TO_TIER.get(value)


def lower_tier(a: str, b: str | None) -> str:
    """The worse of two tiers (a caller may ask for less than its token grants, not more)."""
    if b is None:
        return a
    return max(a, b, key=TIER_ORDER.index)
