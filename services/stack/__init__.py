"""The embedded stack behind `loraplane up`, `loraplane demo` and the test fixtures."""
