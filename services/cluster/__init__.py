"""A multi-host loraplane on one machine: network namespaces, a Kafka quorum, faults."""
