"""The test suite, in folders by kind (see tests/README.md)."""
