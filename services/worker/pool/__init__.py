"""The tiered adapter pool below the engine's device slots: host, disk and blob tiers,
the LRU-K eviction rule they share, and the loader thread that moves adapters up."""
