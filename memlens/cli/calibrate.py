"""`memlens calibrate`: measure this GPU's timing table (matmul, attention, bandwidth, launch, PCIe, NCCL) in
about a minute and write it as JSON; estimate, compare and fit price step time with it (``--timing-table FILE``).

    memlens calibrate                          (writes ./<gpu>_timing.json)
    memlens calibrate --out h100_timing.json --quick
    memlens estimate --model gpt2 --timing-table h100_timing.json
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..core.errors import SpecError
from .common import whole  # noqa: F401 - the verb modules share common's parsers


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("calibrate", help="measure this GPU's step-time table (matmul/attention rates, bandwidth, "
                              "launch, PCIe, NCCL) and write it as JSON", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="FILE", help="where to write the table (default: ./<gpu>_timing.json)")
    p.add_argument("--device", default="cuda", metavar="DEV", help="the CUDA device to measure (default cuda)")
    p.add_argument("--quick", action="store_true", help="small grids (seconds; a smoke test, marked not calibrated)")
    p.add_argument("--no-nccl", action="store_true", help="skip the collectives even with several GPUs")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..measure.calibrate import calibrate  # heavy: the measuring side loads torch

    table = calibrate(args.device, quick=args.quick, nccl=not args.no_nccl)
    path = table.write(args.out or f"{table.gpu}_timing.json")
    print(f"wrote {path} ({table.device_name}); use it with --timing-table {path}")
    return 0


def add_table_arg(p: argparse.ArgumentParser) -> None:
    """``--timing-table FILE`` for a verb that predicts step time."""
    p.add_argument("--timing-table", metavar="FILE", help="price step time with this table (memlens calibrate writes one; "
                   "default: the shipped table of --gpu, else its data sheet, said 'uncalibrated')")


def use_table(args: argparse.Namespace, spec=None) -> None:
    """Check ``--timing-table`` now (one clear line) and hand it to the estimator (and its worker processes)."""
    path = getattr(args, "timing_table", None)
    if not path:
        return
    from ..estimator.timing.tables import ENV_TABLE, read_table

    if not Path(path).is_file():
        raise SpecError(f"--timing-table {path}: no such file", hint="memlens calibrate --out FILE writes one on the GPU")
    read_table(path)
    os.environ[ENV_TABLE] = str(Path(path).resolve())
