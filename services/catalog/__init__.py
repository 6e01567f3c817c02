"""The catalog: the one fold of the adapter log and the serving rules built on it.

Registry, workers and router import this package; none keeps a copy of these rules.
"""
