"""amp-runner: declarative mixed-precision training experiments (Apex O0-O3 on modern PyTorch)."""

__version__ = "0.1.0"
