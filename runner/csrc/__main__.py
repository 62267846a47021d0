"""`python -m runner.csrc build`: compile the kernels ahead of time and report what was built.

Builds the C++ kernels, and the CUDA kernels where a CUDA toolkit is found (for the GPUs present,
or TORCH_CUDA_ARCH_LIST), into the cache the runner loads them from. Exit status 1 when a build
that was asked for (or, with no --backend, the C++ one) failed; the compiler's output is shown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from runner import csrc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.csrc", description="Build amp-runner's fused kernels."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="compile the kernels into the per-user cache")
    build.add_argument(
        "--backend",
        choices=[*csrc.BACKENDS, "all"],
        default=None,
        help="cpp, cuda or all (default: cpp, plus cuda when a toolkit is found)",
    )
    build.add_argument("-v", "--verbose", action="store_true", help="show the compiler output")
    build.add_argument(
        "--background",
        action="store_true",
        help="as a run starts it when the kernels are not built yet: at the lowest "
        "CPU priority, and a failure is recorded for later runs",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.background:
        os.nice(19)

    if args.backend in (None, "all"):
        wanted = ["cpp"]
        if args.backend == "all" or csrc.cuda_toolkit() is not None:
            wanted.append("cuda")
    else:
        wanted = [args.backend]
    failed = False
    for backend in wanted:
        started = time.perf_counter()
        if not args.background:  # asked for by hand: try again whatever failed before
            csrc.clear_background_failure(backend)
        try:
            kernels = csrc.build(backend, verbose=args.verbose)
        except csrc.KernelBuildError as error:
            print(f"{backend}: FAILED\n{error}", file=sys.stderr)
            if args.background:
                csrc.record_background_failure(backend, str(error))
            failed = True
            continue
        extra = f", arch list {csrc.cuda_arch_list()}" if backend == "cuda" else ""
        print(
            f"{backend}: ready in {time.perf_counter() - started:.0f} s "
            f"({kernels.ops.__file__}{extra})"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
