#!/usr/bin/env python3
"""Writes a copy of Debian's libtorch_cpu without the libraries of Caffe2's image, video and
database operators among its DT_NEEDED entries (Note [A leaner LibTorch for the tests] in
tests/CMakeLists.txt).

    drop_needed.py --list LIB        prints LIB's soname, then each entry it would drop
    drop_needed.py LIB OUT           writes the copy to OUT
    drop_needed.py --check LIB OUT   checks that OUT is the copy this script writes of LIB

Only the dynamic section changes: the entries dropped are taken out of its array, the ones after
them move up, and DT_NULL fills the end. The version requirements of the library name none of
them (checked), so the dynamic linker has nothing else to look for. A call into a library that
is no longer loaded fails at that call ("symbol lookup error"), never silently.
"""
import fnmatch
import os
import struct
import sys

# Caffe2's operators on images and video (OpenCV, FFmpeg), its databases (LMDB, LevelDB with
# Snappy, ZeroMQ) and OpenCL: nothing of tandem, LibTorch's ATen or c10d calls them.
DROPPED = ["libopencv_*", "libavcodec.so*", "libavformat.so*", "libavutil.so*", "libswscale.so*",
           "libswresample.so*", "liblmdb.so*", "libleveldb.so*", "libsnappy.so*", "libzmq.so*",
           "libOpenCL.so*"]

DT_NULL, DT_NEEDED, DT_STRTAB, DT_SONAME, DT_VERNEED, DT_VERNEEDNUM = 0, 1, 5, 14, 0x6FFFFFFE, 0x6FFFFFFF
PT_LOAD, PT_DYNAMIC = 1, 2


class Elf:
    def __init__(self, data):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        phoff = struct.unpack_from("<Q", data, 0x20)[0]
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        self.data = data
        self.loads = []
        self.dynamic = None
        for i in range(phnum):
            p_type, _, offset, vaddr, _, filesz, _, _ = struct.unpack_from(
                "<IIQQQQQQ", data, phoff + i * phentsize)
            if p_type == PT_LOAD:
                self.loads.append((vaddr, offset, filesz))
            elif p_type == PT_DYNAMIC:
                self.dynamic = (offset, filesz)
        if self.dynamic is None:
            raise ValueError("no dynamic section: not a shared library")
        self.entries = [struct.unpack_from("<qQ", data, self.dynamic[0] + 16 * i)
                        for i in range(self.dynamic[1] // 16)]
        self.strtab = self.offset(self.value(DT_STRTAB))

    def value(self, tag):
        return next((v for t, v in self.live() if t == tag), None)

    def live(self):
        for t, v in self.entries:
            if t == DT_NULL:
                return
            yield t, v

    def offset(self, vaddr):
        for start, offset, size in self.loads:
            if start <= vaddr < start + size:
                return offset + vaddr - start
        raise ValueError("address 0x%x is in no loaded segment" % vaddr)

    def string(self, index):
        at = self.strtab + index
        return self.data[at:self.data.index(b"\0", at)].decode()

    def needed(self):
        return [self.string(v) for t, v in self.live() if t == DT_NEEDED]

    def version_files(self):
        """The files the version requirements (.gnu.version_r) name."""
        at, count = self.value(DT_VERNEED), self.value(DT_VERNEEDNUM)
        files = []
        if at is None:
            return files
        at = self.offset(at)
        for _ in range(count or 0):
            _, _, file, _, next_ = struct.unpack_from("<HHIII", self.data, at)
            files.append(self.string(file))
            if not next_:
                break
            at += next_
        return files


def dropped(names):
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in DROPPED)]


def slim(source):
    """The bytes of the copy of `source` and the entries it drops; raises ValueError if none."""
    data = bytearray(open(source, "rb").read())
    elf = Elf(data)
    gone = dropped(elf.needed())
    if not gone:
        raise ValueError("%s: needs none of %s; nothing to drop" % (source, " ".join(DROPPED)))
    named = set(gone) & set(elf.version_files())
    if named:
        raise ValueError("%s: its version requirements name %s; they cannot be dropped" %
                         (source, " ".join(sorted(named))))
    kept = [(t, v) for t, v in elf.live() if not (t == DT_NEEDED and elf.string(v) in gone)]
    kept += [(DT_NULL, 0)] * (len(elf.entries) - len(kept))
    for i, (t, v) in enumerate(kept):
        struct.pack_into("<qQ", data, elf.dynamic[0] + 16 * i, t, v)
    # What is written is the source less exactly the dropped entries.
    expected = [n for n in elf.needed() if n not in gone]
    if Elf(bytes(data)).needed() != expected:
        raise ValueError("%s: the copy would need %s, expected %s" %
                         (source, Elf(bytes(data)).needed(), expected))
    return bytes(data), gone


def main(argv):
    try:
        if len(argv) == 3 and argv[1] == "--list":
            elf = Elf(open(argv[2], "rb").read())
            soname = elf.value(DT_SONAME)
            print(elf.string(soname) if soname is not None else os.path.basename(argv[2]))
            for name in dropped(elf.needed()):
                print(name)
            return 0
        if len(argv) == 4 and argv[1] == "--check":
            data, gone = slim(argv[2])
            if open(argv[3], "rb").read() != data:
                print("%s is not %s less %s" % (argv[3], argv[2], " ".join(gone)), file=sys.stderr)
                return 1
            print("%s: %s less %s" % (argv[3], argv[2], " ".join(gone)))
            return 0
        if len(argv) != 3:
            print(__doc__, file=sys.stderr)
            return 2
        data, _ = slim(argv[1])
    except (OSError, ValueError) as e:
        print("drop_needed.py: %s" % e, file=sys.stderr)
        return 1
    out = argv[2]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    partial = out + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.chmod(partial, 0o755)
    os.replace(partial, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
