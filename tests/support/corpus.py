"""Checkpoints for the integrity and scan tests: clean ones of many shapes, lookalikes, and
corrupt ones made by real 4-rank races.

Library side (imported by tests): clean_checkpoints(), lookalikes(), truncated_copies(),
flip_tensor_byte(), race_checkpoints(), single_rank_output().

Worker side: run under torchrun, every rank saves the same kind of state as monitor.cli.demo_job
(its model, per-rank RNG state, per-rank data-loader tensor, writer_rank) to one shared path
per round, `--rounds` times, with a barrier before each save so the writes overlap. One
launch gives many races: a torchrun start costs ~10 s on 2 cores, a round ~0.3 s.

    python -m torch.distributed.run --standalone --nproc-per-node 4 tests/support/corpus.py \
        --out DIR --rounds 20 --width 2048
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


# ---------------------------------------------------------------------------- clean files

def _clean_objects():
    """name -> (object, save kwargs). Varied on purpose: containers, sizes, dtypes, views."""
    import collections

    import torch
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 64, generator=g)
    shared = torch.arange(100, dtype=torch.float32)
    lin = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 16)).sum().backward()
    opt.step()
    objs = {
        "empty_dict": ({}, {}),
        "empty_list": ([], {}),
        "scalar_tensor": (torch.tensor(3.5), {}),
        "zero_size_tensor": (torch.empty(0, 7), {}),
        "plain_python": ({"epoch": 3, "lr": 1e-3, "name": "x" * 300, "flags": [True, None]},
                         {}),
        "nested_containers": ({"a": [torch.ones(3), (torch.zeros(2, 2), {"b": torch.eye(3)})],
                               "c": collections.OrderedDict(d=torch.arange(5))}, {}),
        "big_tensor": ({"w": torch.randn(1024, 1024, generator=g)}, {}),   # 4 MiB
        "many_small_tensors": ({f"t{i}": torch.full((i % 7 + 1,), float(i))
                                for i in range(600)}, {}),
        "all_dtypes": ({str(dt): torch.ones(5, dtype=dt) for dt in (
            torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
            torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
            torch.complex128)}, {}),
        "new_dtypes": ({str(dt): torch.zeros(6, dtype=dt) for dt in (
            torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
            torch.complex32)}, {}),
        "views_shared_storage": ({"full": shared, "slice": shared[10:20], "view": shared.view(
            10, 10), "strided": base[:, ::2], "t": base.t()}, {}),
        "same_tensor_twice": ({"a": base, "b": base}, {}),
        "noncontiguous": (base.t().contiguous()[::3], {}),
        "module_state_dict": (torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3),
                                                  torch.nn.BatchNorm2d(8)).state_dict(), {}),
        "optimizer_state": ({"model": lin.state_dict(), "opt": opt.state_dict()}, {}),
        "rng_state": ({"cpu": torch.get_rng_state()}, {}),
        "pickle_protocol_4": ({"w": torch.randn(10, generator=g), "n": 1}, {
            "pickle_protocol": 4}),
        "legacy_format": ({"w": torch.randn(50, generator=g), "i": torch.arange(7)},
                          {"_use_new_zipfile_serialization": False}),
        "legacy_views_dtypes": ({"s": shared[5:9], "h": torch.ones(3, dtype=torch.float16),
                                 "u": torch.zeros(2, dtype=torch.uint16)},
                                {"_use_new_zipfile_serialization": False}),
        "legacy_empty_dict": ({}, {"_use_new_zipfile_serialization": False}),
        "tensor_list": ([torch.randn(3, 3, generator=g) for _ in range(40)], {}),
        "sparse_like_bytes": ({"b": b"\x00" * 5000, "t": torch.zeros(4096, dtype=torch.uint8)},
                              {}),
    }
    return objs


def clean_checkpoints(directory: str) -> dict[str, str]:
    """Write the clean corpus into directory; return {name: path}. >= 20 torch files plus
    safetensors files when the safetensors package is installed."""
    import torch
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for name, (obj, kwargs) in _clean_objects().items():
        path = os.path.join(directory, name + ".pt")
        torch.save(obj, path, **kwargs)
        paths[name] = path
    try:
        from safetensors.torch import save_file
    except ImportError:
        return paths
    g = torch.Generator().manual_seed(1)
    tensors = {
        "st_single": {"w": torch.randn(32, 32, generator=g)},
        "st_dtypes": {str(dt).split(".")[1]: torch.ones(3, 2, dtype=dt) for dt in (
            torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8,
            torch.uint8, torch.bool, torch.float64)},
        "st_scalar_and_empty": {"s": torch.tensor(1.0), "e": torch.empty(0, 4)},
        "st_many": {f"layer.{i}.weight": torch.randn(i + 1, generator=g) for i in range(200)},
    }
    for name, t in tensors.items():
        path = os.path.join(directory, name + ".safetensors")
        save_file(t, path, metadata={"format": "pt"} if name == "st_single" else None)
        paths[name] = path
    return paths


# ---------------------------------------------------------------------------- lookalikes

LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
               b"size 438012345\n")
HTML_PAGE = (b"<!DOCTYPE html>\n<html><head><title>403 Forbidden</title></head>\n"
             b"<body><h1>Access denied</h1></body></html>\n")


def lookalikes(directory: str) -> dict[str, str]:
    """Files named like checkpoints that are not: an LFS pointer, an HTML page, an empty file."""
    os.makedirs(directory, exist_ok=True)
    out = {}
    for name, data in (("lfs_pointer.pt", LFS_POINTER), ("error_page.bin", HTML_PAGE),
                       ("empty.ckpt", b"")):
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.write(data)
        out[name] = path
    return out


def truncated_copies(src: str, directory: str, fractions=(0.1, 0.5, 0.9, 0.999)) -> list:
    """Copies of src cut at several offsets (an interrupted download or copy)."""
    os.makedirs(directory, exist_ok=True)
    with open(src, "rb") as f:
        data = f.read()
    stem, ext = os.path.splitext(os.path.basename(src))
    out = []
    for frac in fractions:
        cut = max(1, min(len(data) - 1, int(len(data) * frac)))
        path = os.path.join(directory, f"{stem}.cut{cut}{ext}")
        with open(path, "wb") as f:
            f.write(data[:cut])
        out.append(path)
    return out


def flip_tensor_byte(src: str, dst: str) -> str:
    """Copy src with one byte flipped in the middle of its largest tensor record: every size
    and header still agrees, only the CRC (deep check) can tell."""
    shutil.copyfile(src, dst)
    with zipfile.ZipFile(src) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename),
                   key=lambda i: i.file_size)
    with open(dst, "r+b") as f:
        f.seek(info.header_offset + 26)
        nlen, xlen = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        pos = info.header_offset + 30 + nlen + xlen + info.file_size // 2
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))
    return dst


# ---------------------------------------------------------------------------- hostile files

def torch_zip_bytes(pickle_bytes: bytes, prefix: str = "archive", extra: dict | None = None) -> bytes:
    """A structurally valid torch zip (stored records, a version record) around any data.pkl:
    the verifier's pickle reader is then the only thing that judges it."""
    import io
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{prefix}/data.pkl", pickle_bytes)
        z.writestr(f"{prefix}/byteorder", b"little")
        for name, data in (extra or {}).items():
            z.writestr(f"{prefix}/{name}", data)
        z.writestr(f"{prefix}/version", b"3\n")
    return buf.getvalue()


def memo_bomb_pickle(index: int = 2 ** 27) -> bytes:
    """PROTO 2, NONE, LONG_BINPUT index, STOP: an unpickler that stores its memo in an array
    grows the array to hold `index` entries (2**27: 2 GB) for an 11-byte pickle."""
    import struct
    return b"\x80\x02N" + b"r" + struct.pack("<I", index) + b"."


def memo_bomb(path: str, index: int = 2 ** 27) -> str:
    with open(path, "wb") as f:
        f.write(torch_zip_bytes(memo_bomb_pickle(index)))
    return path


_MEASURED = r"""
import atexit, os, resource, runpy, sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
def report():
    with open("/proc/self/status") as f:
        peak = [line.split()[1] for line in f if line.startswith("VmHWM:")][0]
    os.write(2, b"\nPEAK_RSS_KB " + peak.encode() + b"\n")
atexit.register(report)
mode, target, *rest = sys.argv[2:]
sys.argv = [target] + rest
if mode == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
"""


def run_measured(python_args: list, env: dict | None = None, limit_bytes: int = 1 << 30,
                 timeout: float = 120):
    """Run `python ARGS` (["-m", module, ...] or ["-c", code, ...]) under an address-space
    cap (a regression then fails with MemoryError instead of swapping the machine). Returns
    (returncode, stdout, stderr, peak RSS in bytes). The peak is the child's own VmHWM, read
    at exit: rusage from wait4 would count the pytest process the child was forked from."""
    proc = subprocess.run([sys.executable, "-c", _MEASURED, str(limit_bytes), *python_args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    err, _, peak = proc.stderr.rpartition("\nPEAK_RSS_KB ")
    if not peak.strip().isdigit():          # died before atexit (killed, or a crash)
        return proc.returncode, proc.stdout, proc.stderr, None
    return proc.returncode, proc.stdout, err, int(peak) * 1024


# ---------------------------------------------------------------------------- real races

def race_checkpoints(directory: str, rounds: int = 20, width: int = 2048,
                     nproc: int = 4, timeout: float = 300) -> list[str]:
    """Run one real torchrun job whose ranks all save to race-<i>.pt each round; return the
    raced files. Each rank also saves its own state once as ref-rank<r>.pt (see
    single_rank_output)."""
    os.makedirs(directory, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", os.path.abspath(__file__), "--out", directory,
           "--rounds", str(rounds), "--width", str(width)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTWATCH_")}
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"race job failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [os.path.join(directory, f"race-{i}.pt") for i in range(rounds)]


def single_rank_output(path: str, directory: str) -> int | None:
    """If torch.load reads the file and what it holds is exactly one rank's state (demo_job's
    consistency() passes and every tensor and value equals that rank's reference save), that
    rank; else None. Such a file is a valid save that merely won the race: not corrupt."""
    import torch

    from monitor.cli.demo_job import consistency
    try:
        state = torch.load(path, weights_only=True)
        if consistency(state) is not None:
            return None
        rank = state["writer_rank"]
        ref = torch.load(os.path.join(directory, f"ref-rank{rank}.pt"), weights_only=True)
    except Exception:
        return None
    return rank if _same(state, ref) else None


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _race_worker(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from torch import nn

    from monitor.cli.demo_job import sampler_indices
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--same-layout", action="store_true",
                   help="every rank's state has the same byte layout (same tensor lengths, "
                        "different values): a torn file then keeps a valid structure and "
                        "torch.load accepts it, while its records' CRCs show the mix")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1000 + rank)
    # Same content as monitor.cli.demo_job saves: identical weights, per-rank RNG state and
    # data-loader tensor (different lengths), so colliding writes carry different bytes.
    state = {"epoch": 0, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "rng": torch.get_rng_state(), "sampler_indices": (torch.arange(rank * 1000, rank * 1000 + 5000) if args.same_layout
                                 else sampler_indices(rank)),
             "writer_rank": rank}
    torch.save(state, os.path.join(args.out, f"ref-rank{rank}.pt"))
    for i in range(args.rounds):
        dist.barrier()
        torch.save(state, os.path.join(args.out, f"race-{i}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(_race_worker())
