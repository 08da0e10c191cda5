"""onnxruntime-gpu for one lease of the GPU machine, in as few calls as the carry limit allows.

    python tools/gpu_wheel.py pack [--parts .gpu] [--files .gpu/files/files.tar.xz] [--out .gpu]

Reads the wheel that ../shared/tools/gpu-ort-wheel.sh unpacked into .gpu/p1..pN (an xz tar in
parts, ~204 MB), and writes .gpu/c1, .gpu/c2, ...: one folder per device call, the first also
holding the exported files. Each folder plus the working tree fits one call's 64 MiB.

What makes it small (60 MB instead of 204 MB):
- the CUDA provider's fat binary keeps the sm_90 machine code (H100 and H200) and has every other
  architecture's cubin payload zeroed in place: the entries' headers stay, so the driver still
  reads the same table and picks sm_90, and the zeros compress to nothing;
- the C API library (libonnxruntime.so.*) is dropped: the Python module links the runtime
  statically and never loads it;
- xz -9e (a 64 MiB dictionary).
"""
from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 << 20  # what one device call carries: the working tree plus its carried paths
MARGIN = 2 << 20  # the tree grows by a commit or two between packing and the lease
FATBIN_MAGIC = 0xBA55ED50
KEEP_ARCH = 90  # H100 / H200


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(offset, size) of an ELF64 little-endian section."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names_off = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        header = shoff + i * shentsize
        name_at, = struct.unpack_from("<I", data, header)
        end = data.index(b"\0", names_off + name_at)
        if data[names_off + name_at:end].decode() == name:
            offset, size = struct.unpack_from("<QQ", data, header + 0x18)
            return offset, size
    raise ValueError(f"no section {name}")


def zero_other_arches(data: bytearray, start: int, size: int, keep: int = KEEP_ARCH) -> dict[int, int]:
    """Zero, in place, the payload of every fat-binary entry in data[start:start+size] built for
    another architecture than `keep`. Returns bytes zeroed per architecture. A fat binary: a
    16-byte header (magic, version, header size, payload size), then entries, each a header
    (kind, version, header size, payload size, ..., arch at +28) and its payload."""
    zeroed: dict[int, int] = {}
    p, end = start, start + size
    while p + 16 <= end:
        magic, _, header, total = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # the section pads fat binaries to 8 bytes
            continue
        q, last = p + header, p + header + total
        while q < last:
            _, _, entry_header, payload = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            if arch != keep:
                data[q + entry_header:q + entry_header + payload] = bytes(payload)
                zeroed[arch] = zeroed.get(arch, 0) + payload
            q += entry_header + payload
        p = last
    return zeroed


def slim(wheel_dir: Path) -> dict[int, int]:
    """The unpacked wheel made small, in place (see the module's docstring)."""
    capi = wheel_dir / "onnxruntime" / "capi"
    for lib in capi.glob("libonnxruntime.so*"):
        lib.unlink()
    cuda = capi / "libonnxruntime_providers_cuda.so"
    data = bytearray(cuda.read_bytes())
    zeroed = zero_other_arches(data, *elf_section(data, ".nv_fatbin"))
    cuda.write_bytes(data)
    return zeroed


def tree_bytes() -> int:
    """What every call carries anyway: the tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def split(blob: Path, files: Path | None, out: Path) -> list[Path]:
    """out/c1 (the files and the wheel's first bytes), out/c2, ...: each within one call."""
    room = CALL_LIMIT - MARGIN - tree_bytes()
    data, folders = blob.read_bytes(), []
    first = room - (files.stat().st_size if files else 0)
    if first <= 0 or room <= 0:
        raise SystemExit(f"gpu_wheel: the working tree leaves {room} bytes a call: carry less")
    cuts = [0, first]
    while cuts[-1] < len(data):
        cuts.append(cuts[-1] + room)
    for i, (a, b) in enumerate(zip(cuts, cuts[1:]), start=1):
        folder = out / f"c{i}"
        folder.mkdir(parents=True)
        (folder / f"ort.tar.xz.{i}").write_bytes(data[a:min(b, len(data))])
        if i == 1 and files:
            (folder / files.name).write_bytes(files.read_bytes())
        folders.append(folder)
    return folders


def pack(parts: Path, files: Path | None, out: Path) -> list[Path]:
    for old in out.glob("c[0-9]*"):
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    with tempfile.TemporaryDirectory(prefix="ortgpu-") as tmp:
        wheel = Path(tmp) / "wheel"
        chunks = sorted(parts.glob("p[0-9]*/*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
        if not chunks:
            raise SystemExit(f"gpu_wheel: no parts under {parts}/p*: run ../shared/tools/gpu-ort-wheel.sh first")
        wheel.mkdir()
        cat = subprocess.Popen(["cat", *map(str, chunks)], stdout=subprocess.PIPE)
        xz = subprocess.Popen(["xz", "-d", "-T0"], stdin=cat.stdout, stdout=subprocess.PIPE)
        with tarfile.open(fileobj=xz.stdout, mode="r|") as tar:
            tar.extractall(wheel, filter="data")
        zeroed = slim(wheel)
        print("zeroed (arch: MB):", {a: round(n / 1e6, 1) for a, n in sorted(zeroed.items())})
        blob = Path(tmp) / "ort.tar.xz"
        with blob.open("wb") as sink:
            tar = subprocess.Popen(["tar", "-cf", "-", "-C", str(wheel), "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-9e", "-T0"], stdin=tar.stdout, stdout=sink, check=True)
        print(f"slim wheel: {blob.stat().st_size / 1e6:.1f} MB")
        folders = split(blob, files, out)
    for f in folders:
        print(f, sum(x.stat().st_size for x in f.iterdir()) / 1e6, "MB")
    return folders


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    k = sub.add_parser("pack")
    k.add_argument("--parts", type=Path, default=ROOT / ".gpu", help="where gpu-ort-wheel.sh wrote p1..pN")
    k.add_argument("--files", type=Path, help="the exported files' tarball, carried with the first part")
    k.add_argument("--out", type=Path, default=ROOT / ".gpu")
    args = p.parse_args(argv)
    folders = pack(args.parts, args.files, args.out)
    print(f"{len(folders)} calls: carry " + ", then ".join(str(f.relative_to(ROOT)) if f.is_relative_to(ROOT) else str(f)
                                                          for f in folders))
    return 0


if __name__ == "__main__":
    sys.exit(main())
