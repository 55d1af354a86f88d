"""How long a session's arrays take to read back: `python -m benchmarks.session_arrays [--arrays 20000,80000]`.

A long run's session of the first format (version 1) holds tens of thousands of small arrays (each step's funnel)
in arrays.npz. This writes that many 16-value float32 arrays as that format did (np.savez, uncompressed, stored in a
zip as a session stores it), and times the reader the app uses for it (`_read_arrays`), printing µs per array.
"""

from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
import zipfile

import numpy as np

from engine import session_file as sf


def time_read(n: int) -> float:
    arrays = {f"a{i}": np.arange(16, dtype=np.float32) + i for i in range(n)}
    with tempfile.TemporaryDirectory() as td:
        path = os.path.join(td, "arrays.zip")
        npz = io.BytesIO()
        np.savez(npz, **arrays)
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("arrays.npz", npz.getvalue())
        t0 = time.perf_counter()
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as z:
            got = sf._read_arrays(z, z.getinfo("arrays.npz"), fh)
        seconds = time.perf_counter() - t0
    if len(got) != n or not np.array_equal(got[f"a{n - 1}"], arrays[f"a{n - 1}"]):
        raise SystemExit("the arrays read back differ from those written")
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arrays", default="20000,80000", help="comma-separated counts")
    a = p.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for n in (int(x) for x in a.arrays.split(",")):
        s = time_read(n)
        print(f"{n:>7,} arrays: {s:.2f} s, {s / n * 1e6:.0f} µs an array")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
