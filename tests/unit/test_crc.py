"""monitor.verify.crc: the accelerated CRC32 must agree with zlib's bit for bit, and a broken or
missing accelerator must fall back to zlib rather than call every checkpoint corrupt."""
import os
import random
import zlib

from monitor.verify import crc


def test_backend_agrees_with_zlib_including_chained_calls():
    rng = random.Random(3)
    for size in (0, 1, 7, 4096, 5 * 1024 + 3, 1 << 20):
        data = os.urandom(size)
        assert crc.crc32(data) == zlib.crc32(data)
        cut = rng.randrange(size + 1)
        assert crc.crc32(data[cut:], crc.crc32(data[:cut])) == zlib.crc32(data)
        assert crc.crc32(memoryview(data)) == zlib.crc32(data)


def test_broken_or_failing_accelerators_fall_back_to_zlib():
    def wrong(data, value=0):
        return zlib.crc32(data, value) ^ 1

    def raises(data, value=0):
        raise RuntimeError("illegal instruction")

    assert crc._pick([("wrong", wrong), ("raises", raises)]) == ("zlib", zlib.crc32)
    assert crc._pick([("raises", raises), ("good", zlib.crc32)]) == ("good", zlib.crc32)
    assert crc._pick([]) == ("zlib", zlib.crc32)


def test_backend_is_named():
    assert crc.BACKEND in ("zlib-ng", "isal", "zlib")
