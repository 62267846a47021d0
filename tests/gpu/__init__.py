"""Tests that need a CUDA device (marked `gpu`, skipped without one)."""
