"""`python -m dspark.kernels`: build the CPU kernels now (scripts/setup.sh runs it) and say where."""

import os
import sys

from dspark import kernels

if __name__ == "__main__":
    os.environ.setdefault("DSPARK_CPU_KERNELS", "require")
    if kernels._mode() == "0":
        sys.exit("DSPARK_CPU_KERNELS=0: kernels are off, nothing to build")
    kernels.ops()  # with the block products (cpu_ops_blocks.inc)
    print(f"dspark CPU kernels built in {kernels.build_dir()}")
