"""Which tensor storages does a torch pickle name? Answered without importing or running
anything the pickle names.

`persistent_storages(data) -> {key: (storage type name, numel)}` for every
('storage', <type>, key, location, numel) persistent id in `data.pkl` (or a legacy file's
object pickle); `pickle_names(data)` adds the globals the pickle names ("module.name"), which
say whether torch.load(weights_only=True) would load it (monitor.verify.loadable). Raises ValueError (or a subclass: UnicodeDecodeError...) with the reason when
the bytes are not a valid pickle.

Two readers answer the same question:

- fast: the C unpickler (pickle.Unpickler) with `find_class` replaced so that every global the
  pickle names becomes an inert placeholder class, and `persistent_load` recording storage ids.
  Nothing is imported; the only code that runs is the placeholder's own do-nothing methods
  (Python's documented "restricting globals" pattern, taken to the end: no global is allowed).
  About 20x faster than a Python loop over the opcodes; it dominated the structural check.
- careful: a hand-rolled stack machine over pickletools' opcode table, used when the fast
  reader fails, so a damaged pickle gets the careful reader's precise reason (and a pickle the
  fast reader cannot follow is still judged).

Memory is bounded for any input (the agent is a root daemon reading strangers' files):
- The C unpickler keeps its memo in an array indexed by the memo number, so one
  `LONG_BINPUT 2**27` makes it fill a 2 GB table; it also allocates a claimed string length
  before reading it, and turns one input byte into up to ~240 bytes of objects (EMPTY_SET).
  So it only sees pickles of at most FAST_MAX_BYTES that a cheap pass over the opcodes
  (`_fits_fast_reader`) found well-formed: memo numbers in order, every claimed length inside
  the data. Anything else goes to the careful reader.
- The careful reader keeps its memo in a list and refuses a memo number no pickler writes
  (`OutOfBounds`: picklers number entries 0, 1, 2... in order); keeps only the values a
  storage id can be made of (short strings, ints, ('storage', ...) tuples: other tuples
  become None); and every 64 KiB of input checks its stack, memo and the objects it made
  against `budget` (`BeyondBudget`).
"""
from __future__ import annotations

import pickle
import pickletools

from .loadable import canonical

FAST_MAX_BYTES = 128 << 10    # C unpickler: <= ~240 B of objects per input byte -> ~30 MB
BUDGET = 16 << 20             # careful reader: stack + memo + the objects it made, estimated;
                              # ~2M stack/memo slots. 48 MiB cost a third of the agent's
                              # 150 MB ceiling for one hostile file (the soak, issue 8)
CHECK_EVERY = 64 << 10        # input bytes between two budget checks (one push per byte)
MAX_KEPT_STRING = 256         # longer strings cannot be a storage key, type or location


class OutOfBounds(ValueError):
    """The pickle uses an index or size no pickler writes (a crafted file, or damage)."""


class BeyondBudget(Exception):
    """The pickle may be valid but is too big to judge within the memory budget."""


MAX_GLOBALS = 256             # distinct global names kept per pickle (beyond: "<more>")
MAX_GLOBAL_TEXT = 200         # characters of a module or name kept
EXTENSION = "<extension>"     # an EXT1/2/4 opcode: a global named by copyreg's registry
MORE = "<more>"               # stands for the names beyond MAX_GLOBALS


def persistent_storages(data: bytes, budget: int = BUDGET) -> dict:
    return pickle_names(data, budget)[0]


def pickle_names(data: bytes, budget: int = BUDGET) -> tuple[dict, frozenset]:
    """(persistent_storages' answer, the globals the pickle names): every class or callable
    it would look up, as "module.name" (at most MAX_GLOBALS of them, then MORE; EXTENSION for
    one named through copyreg's extension registry). Nothing is imported or called.
    monitor.verify.loadable says which of them torch.load(weights_only=True) refuses."""
    if len(data) <= FAST_MAX_BYTES and _fits_fast_reader(data):
        try:
            reader = _Unpickler(data)
            reader.load()
            return reader.found, _names(reader.globals)
        except Exception:           # damaged, or beyond the fast reader: ask the careful one
            pass
    names: set = set()
    return scan_pickle(data, budget, names), _names(names)


def _names(pairs) -> frozenset:
    out = set()
    for module, name in pairs:
        if len(out) >= MAX_GLOBALS:
            out.add(MORE)
            break
        if module is None:
            out.add(EXTENSION if name == EXTENSION else "?.?")
            continue
        out.add(canonical(str(module)[:MAX_GLOBAL_TEXT], str(name)[:MAX_GLOBAL_TEXT]))
    return frozenset(out)


# ---------------------------------------------------------------------------- fast reader

class _Inert:
    """What every object in the pickle becomes: accepts each construction protocol the
    unpickler uses (call, cls.__new__, BUILD, APPENDS, SETITEMS) and keeps nothing.

    Only __init__ is overridden, not __new__: object.__new__ then accepts arguments, and a
    REDUCE costs one Python-level call instead of two (this loop is the hot path)."""

    __slots__ = ("__weakref__",)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _INERT

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


_INERT = _Inert()


class _Reader:
    """The pickle as a file with peek(): the C unpickler then takes it whole in one buffer
    instead of one read() call per opcode (3.6x faster on a torch data.pkl). Reads are
    slices, so a length claimed past the end never allocates more than the data."""

    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def peek(self, n: int = 0) -> bytes:
        return bytes(self.data[self.pos:])

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n is None or n < 0 else min(len(self.data), self.pos + n)
        out = bytes(self.data[self.pos:end])
        self.pos = end
        return out

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n

    def readline(self) -> bytes:
        rest = self.data[self.pos:]
        end = bytes(rest).find(b"\n")
        return self.read(len(rest) if end < 0 else end + 1)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(_Reader(data))
        self.found: dict = {}
        self.globals: dict = {}

    def find_class(self, module, name):
        # A class (not an instance): NEWOBJ insists on calling cls.__new__ of a real type.
        # The key is what the pickle names (EXT codes arrive here resolved by copyreg).
        key = (module, name)
        cls = self.globals.get(key)
        if cls is None:
            cls = self.globals[key] = type("_Inert", (_Inert,), {"__slots__": (),
                                                                  "ckpt_global": key})
        return cls

    def persistent_load(self, pid):
        _record_storage(pid, self.found, _placeholder_name)
        return _INERT


def _fast_storages(data: bytes) -> dict:
    reader = _Unpickler(data)
    reader.load()
    return reader.found


def _placeholder_name(storage_type) -> str | None:
    """The class name a placeholder stands for (the fast reader's storage types)."""
    named = getattr(storage_type, "ckpt_global", None)
    return named[1] if named else None


# ---------------------------------------------------------------------------- careful reader

_MARK = object()

# Argument decoding, from pickletools' own opcode table (so every protocol's opcodes are known
# with their exact argument lengths and stack effects); values are decoded only for the few
# opcodes a persistent id is built from. Hand-rolled rather than pickletools.genops: genops
# does a Python call per argument and made the structural check 2-3x slower.
_A_FIXED, _A_LINE, _A_LEN1, _A_LEN4S, _A_LEN4U, _A_LEN8U, _A_LINES2 = range(7)
_V_NONE, _V_UINT, _V_SINT, _V_LONG, _V_STR, _V_INTLINE, _V_LONGLINE, _V_STRLINE, _V_ULINE = \
    range(9)
(_K_GENERIC, _K_VALUE, _K_MARK, _K_PUT, _K_MEMOIZE, _K_GET, _K_GLOBAL, _K_STACK_GLOBAL,
 _K_TUPLE, _K_TUPLEN, _K_EMPTY_TUPLE, _K_BINPERSID, _K_PERSID, _K_STOP, _K_NOP) = range(15)

_VALUE_OPS = {
    "BININT1": _V_UINT, "BININT2": _V_UINT, "BININT": _V_SINT, "LONG1": _V_LONG,
    "LONG4": _V_LONG, "INT": _V_INTLINE, "LONG": _V_LONGLINE, "BINUNICODE": _V_STR,
    "SHORT_BINUNICODE": _V_STR, "BINUNICODE8": _V_STR, "BINSTRING": _V_STR,
    "SHORT_BINSTRING": _V_STR, "STRING": _V_STRLINE, "UNICODE": _V_ULINE,
}
_KIND_OPS = {
    "MARK": _K_MARK, "BINPUT": _K_PUT, "LONG_BINPUT": _K_PUT, "PUT": _K_PUT,
    "MEMOIZE": _K_MEMOIZE, "BINGET": _K_GET, "LONG_BINGET": _K_GET, "GET": _K_GET,
    "GLOBAL": _K_GLOBAL, "STACK_GLOBAL": _K_STACK_GLOBAL, "TUPLE": _K_TUPLE,
    "TUPLE1": _K_TUPLEN, "TUPLE2": _K_TUPLEN, "TUPLE3": _K_TUPLEN,
    "EMPTY_TUPLE": _K_EMPTY_TUPLE, "BINPERSID": _K_BINPERSID, "PERSID": _K_PERSID,
    "STOP": _K_STOP, "PROTO": _K_NOP, "FRAME": _K_NOP,
}


def _opcode_table() -> list:
    table = [None] * 256
    for op in pickletools.opcodes:
        a = op.arg
        if a is None:
            arg_kind, n = _A_FIXED, 0
        elif op.name in ("GLOBAL", "INST"):
            arg_kind, n = _A_LINES2, 0
        elif a.n >= 0:
            arg_kind, n = _A_FIXED, a.n
        else:
            arg_kind, n = {pickletools.UP_TO_NEWLINE: _A_LINE,
                           pickletools.TAKEN_FROM_ARGUMENT1: _A_LEN1,
                           pickletools.TAKEN_FROM_ARGUMENT4: _A_LEN4S,
                           pickletools.TAKEN_FROM_ARGUMENT4U: _A_LEN4U,
                           pickletools.TAKEN_FROM_ARGUMENT8U: _A_LEN8U}[a.n], 0
        before = op.stack_before
        has_mark = pickletools.markobject in before
        below = before.index(pickletools.markobject) if has_mark else len(before)
        kind = _KIND_OPS.get(op.name, _K_VALUE if op.name in _VALUE_OPS else _K_GENERIC)
        table[ord(op.code)] = (kind, arg_kind, n, _VALUE_OPS.get(op.name, _V_NONE), below,
                               has_mark, len(op.stack_after), op.name)
    return table


_OPCODES = _opcode_table()


# How _fits_fast_reader steps over each opcode: a positive number is the opcode's whole length
# (its argument has a fixed size); the rest need a look at the argument.
_S_UNKNOWN, _S_LEN1, _S_LEN4S, _S_LEN4U, _S_LEN8U, _S_LINE, _S_LINES2, _S_STOP = range(0, -8, -1)


def _skip_table() -> list:
    table = [_S_UNKNOWN] * 256
    for code, spec in enumerate(_OPCODES):
        if spec is None:
            continue
        kind, arg_kind, n = spec[0], spec[1], spec[2]
        table[code] = (_S_STOP if kind == _K_STOP else 1 + n if arg_kind == _A_FIXED else
                       {_A_LEN1: _S_LEN1, _A_LEN4S: _S_LEN4S, _A_LEN4U: _S_LEN4U,
                        _A_LEN8U: _S_LEN8U, _A_LINE: _S_LINE, _A_LINES2: _S_LINES2}[arg_kind])
    for code in (0x71, 0x72, 0x94, 0x70):      # BINPUT, LONG_BINPUT, MEMOIZE, PUT
        table[code] = _S_UNKNOWN - 100 - code
    return table


_SKIP = _skip_table()


def _fits_fast_reader(data: bytes) -> bool:
    """Can the C unpickler read `data` without allocating by a claimed number? True when
    every opcode is known, every claimed length lies inside the data and memo entries are
    numbered in order (so its memo array holds at most one slot per opcode). Steps over the
    opcodes without building anything: ~1/4 of the careful reader's cost."""
    skip, end, i, memo = _SKIP, len(data), 0, 0
    while i < end:
        code = data[i]
        n = skip[code]
        if n > 0:
            i += n
            continue
        if code == 0x71 or code == 0x72 or code == 0x70:      # BINPUT, LONG_BINPUT, PUT
            if code == 0x71:
                index, i = data[i + 1] if i + 1 < end else memo + 1, i + 2
            elif code == 0x72:
                index, i = int.from_bytes(data[i + 1:i + 5], "little"), i + 5
            else:
                j = data.find(b"\n", i + 1)
                digits = data[i + 1:j]
                if j < 0 or not 0 < len(digits) < 12 or not digits.isdigit():
                    return False
                index, i = int(digits), j + 1
            if index > memo:
                return False
            memo += index == memo
        elif code == 0x94:                                      # MEMOIZE
            memo += 1
            i += 1
        elif n == _S_LEN1:
            i += 2 + (data[i + 1] if i + 1 < end else end)
        elif n == _S_LEN4S or n == _S_LEN4U:
            length = int.from_bytes(data[i + 1:i + 5], "little", signed=n == _S_LEN4S)
            if length < 0:              # BINSTRING's is signed: it would step back or stay
                return False
            i += 5 + length
        elif n == _S_LEN8U:
            i += 9 + int.from_bytes(data[i + 1:i + 9], "little")
        elif n == _S_LINE or n == _S_LINES2:
            j = data.find(b"\n", i + 1)
            if j >= 0 and n == _S_LINES2:
                j = data.find(b"\n", j + 1)
            if j < 0:
                return False
            i = j + 1
        elif n == _S_STOP:
            return True
        else:
            return False
    return False


def scan_pickle(data: bytes, budget: int = BUDGET, names: set | None = None) -> dict:
    """The careful reader. Raises ValueError (OutOfBounds for a memo number out of order)
    when the data is not a valid pickle, BeyondBudget when judging it would take more than
    `budget` bytes of memory. names: a set to add the (module, name) pairs of the globals
    the pickle names to (at most MAX_GLOBALS + 1; (None, None) for one whose name is not a
    short string, (None, EXTENSION) for an extension code)."""
    if names is None:
        names = set()
    stack, memo, found = [], [], {}
    table, end, i = _OPCODES, len(data), 0
    append = stack.append
    made = 0                       # bytes of objects made so far (an over-estimate)
    check_at = min(end, CHECK_EVERY)
    while True:
        if i >= check_at:
            if i >= end:
                raise ValueError("ends before STOP (truncated)")
            # At most one push per input byte since the last check: the slack is bounded.
            used = made + 8 * (len(stack) + len(memo))
            if used > budget:
                raise BeyondBudget(f"judging it needs more than {budget >> 20} MiB of memory "
                                   f"({i} of {end} bytes read)")
            check_at = min(end, i + CHECK_EVERY)
        code = data[i]
        # Fast paths for the opcodes that make up most of a torch pickle.
        if code == 0x71:                                  # BINPUT
            _memo_put(memo, data[i + 1], stack)
            i += 2
            continue
        if code == 0x68:                                  # BINGET
            index = data[i + 1]
            append(memo[index] if index < len(memo) else None)
            i += 2
            continue
        if code == 0x4B:                                  # BININT1
            append(data[i + 1])
            i += 2
            continue
        if code == 0x28:                                  # MARK
            append(_MARK)
            i += 1
            continue
        if code == 0x72:                                  # LONG_BINPUT
            _memo_put(memo, int.from_bytes(data[i + 1:i + 5], "little"), stack)
            i += 5
            continue
        if code == 0x6A:                                  # LONG_BINGET
            index = int.from_bytes(data[i + 1:i + 5], "little")
            append(memo[index] if index < len(memo) else None)
            i += 5
            continue
        if code == 0x4D:                                  # BININT2
            append(data[i + 1] | data[i + 2] << 8)
            made += 32
            i += 3
            continue
        if code == 0x52:                                  # REDUCE: callable, args -> obj
            if len(stack) < 2:
                raise ValueError("stack underflow at REDUCE")
            del stack[-1]
            stack[-1] = None
            i += 1
            continue
        if code == 0x74:                                  # TUPLE
            append(_storage_shaped(tuple(_pop_mark(stack))))
            made += 96
            i += 1
            continue
        if code == 0x58:                                  # BINUNICODE
            length = int.from_bytes(data[i + 1:i + 5], "little")
            i += 5 + length
            if i > end:
                raise ValueError("BINUNICODE runs past the end (truncated)")
            if length > MAX_KEPT_STRING:
                append(None)
            else:
                append(data[i - length:i].decode("utf-8", "replace"))
                made += 80 + 4 * length
            continue
        spec = table[code]
        if spec is None:
            raise ValueError(f"unknown opcode {code:#04x} at {i}")
        kind, arg_kind, n, value_kind, below, has_mark, after, name = spec
        i += 1
        raw, i = read_argument(data, i, end, arg_kind, n, name)
        # -- its effect on the stack
        if kind == _K_PUT:
            _memo_put(memo, _memo_index(raw, arg_kind), stack)
        elif kind == _K_GET:
            key = _memo_index(raw, arg_kind)
            stack.append(memo[key] if key < len(memo) else None)
        elif kind == _K_VALUE:
            stack.append(None if raw is None else _decode_value(value_kind, raw))
            made += 80 + 4 * len(raw or b"")
        elif kind == _K_MARK:
            stack.append(_MARK)
        elif kind == _K_TUPLE:
            stack.append(_storage_shaped(tuple(_pop_mark(stack))))
            made += 96
        elif kind == _K_TUPLEN:
            count = int(name[-1])
            if count > len(stack):
                raise ValueError(f"stack underflow at {name}")
            del stack[-count:]
            stack.append(None)          # a storage id has 5 or more items
        elif kind == _K_GENERIC:
            if len(names) <= MAX_GLOBALS:
                if name == "INST":
                    names.add((raw[0][:MAX_GLOBAL_TEXT].decode("utf-8", "replace"),
                               raw[1][:MAX_GLOBAL_TEXT].decode("utf-8", "replace")))
                elif name in ("EXT1", "EXT2", "EXT4"):
                    names.add((None, EXTENSION))
            if has_mark:
                _pop_mark(stack)
            if below:
                if below > len(stack):
                    raise ValueError(f"stack underflow at {name}")
                del stack[-below:]
            if after:
                stack.append(None)
        elif kind == _K_MEMOIZE:
            if not stack:
                raise ValueError("stack underflow at MEMOIZE")
            memo.append(stack[-1])
        elif kind == _K_GLOBAL:
            module_name = (raw[0][:MAX_GLOBAL_TEXT].decode("utf-8", "replace"),
                           raw[1][:MAX_GLOBAL_TEXT].decode("utf-8", "replace"))
            stack.append(("global",) + module_name)
            if len(names) <= MAX_GLOBALS:
                names.add(module_name)
            made += 200 + 4 * (len(module_name[0]) + len(module_name[1]))
        elif kind == _K_STACK_GLOBAL:
            if len(stack) < 2:
                raise ValueError("stack underflow at STACK_GLOBAL")
            qual, module = stack.pop(), stack.pop()
            stack.append(("global", module, qual))
            if len(names) <= MAX_GLOBALS:
                names.add((module, qual) if type(module) is str and type(qual) is str
                           else (None, None))
            made += 64
        elif kind == _K_EMPTY_TUPLE:
            stack.append(())
        elif kind == _K_BINPERSID:
            if not stack:
                raise ValueError("stack underflow at BINPERSID")
            _record_storage(stack.pop(), found)
            stack.append(None)
            made += 200
        elif kind == _K_PERSID:
            stack.append(None)          # protocol 0 ids are strings, never torch's tuples
        elif kind == _K_STOP:
            return found
        elif name == "FRAME" and int.from_bytes(raw, "little") > end - i:
            raise ValueError(f"FRAME of {int.from_bytes(raw, 'little')} bytes runs past the "
                             "end (truncated)")
        # _K_NOP: PROTO, FRAME



def read_argument(data: bytes, i: int, end: int, arg_kind: int, n: int, name: str):
    """(raw, next offset) of the argument of an opcode whose argument starts at `i`, checked
    against `end` (a claimed length past it is a truncated pickle, never an allocation).
    Long values come back as None: only short ones can be part of a storage id, and a slice
    of a long one would be a copy of up to the whole pickle. Shared by the careful readers
    (scan_pickle here, monitor.verify.dcpmeta)."""
    if arg_kind == _A_FIXED:
        raw = data[i:i + n]
        i += n
    elif arg_kind == _A_LINE:
        j = data.index(b"\n", i)
        raw, i = data[i:j], j + 1
    elif arg_kind == _A_LINES2:
        j = data.index(b"\n", i)
        k = data.index(b"\n", j + 1)
        raw, i = (data[i:j], data[j + 1:k]), k + 1
    else:
        width = 1 if arg_kind == _A_LEN1 else 8 if arg_kind == _A_LEN8U else 4
        length = int.from_bytes(data[i:i + width], "little", signed=arg_kind == _A_LEN4S)
        if length < 0:
            raise ValueError(f"negative length at {i}")
        i += width
        if i + length > end:
            raise ValueError(f"{name} runs past the end (truncated)")
        raw = data[i:i + length] if length <= MAX_KEPT_STRING else None
        i += length
    if i > end:
        raise ValueError(f"{name} runs past the end (truncated)")
    return raw, i

def _memo_index(raw: bytes, arg_kind: int) -> int:
    if arg_kind != _A_LINE:
        return int.from_bytes(raw, "little")
    if not raw.isdigit() or len(raw) > 18:
        raise ValueError(f"bad memo index {raw[:20]!r}")
    return int(raw)


def _memo_put(memo: list, index: int, stack: list) -> None:
    """Picklers number memo entries 0, 1, 2... as they store them: an index beyond the next
    one is a crafted or damaged file, and the C unpickler would allocate a table that big."""
    if not stack:
        raise ValueError("stack underflow at PUT")
    if index < len(memo):
        memo[index] = stack[-1]
    elif index == len(memo):
        memo.append(stack[-1])
    else:
        raise OutOfBounds(f"out of bounds: memo entry {index} stored after {len(memo)} "
                          "entries (picklers number them in order; a crafted file?)")


def _storage_shaped(items: tuple):
    """Keep a tuple only if it can be a storage id: ('storage', type, key, location, numel
    [, view]); anything else becomes None, so nested tuples cannot pile up in memory."""
    return items if len(items) >= 5 and items[0] == "storage" else None


def _decode_value(value_kind: int, raw: bytes):
    if value_kind == _V_STR:
        return raw.decode("utf-8", "replace")
    if value_kind == _V_UINT:
        return int.from_bytes(raw, "little")
    if value_kind == _V_SINT or value_kind == _V_LONG:
        return int.from_bytes(raw, "little", signed=True)
    if value_kind == _V_INTLINE:
        return {b"00": False, b"01": True}.get(raw) if raw in (b"00", b"01") else int(raw)
    if value_kind == _V_LONGLINE:
        return int(raw.rstrip(b"L"))
    if value_kind == _V_STRLINE:
        return raw.strip(b"'\"").decode("latin-1")
    if value_kind == _V_ULINE:
        return raw.decode("raw_unicode_escape")
    return None


def _pop_mark(stack: list) -> list:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is _MARK:
            items = stack[i + 1:]
            del stack[i:]
            return items
    raise ValueError("mark not found")


def _global_name(storage_type) -> str | None:
    """The class name of a ("global", module, name) tuple (the careful reader's globals)."""
    if isinstance(storage_type, tuple) and len(storage_type) == 3:
        return storage_type[2]
    return None


def _record_storage(pid, found: dict, type_name=_global_name) -> None:
    """Both readers' rule for one persistent id: a ('storage', type, key, location, numel)
    tuple is recorded as found[key] = (type name, numel); `type_name` names the type as that
    reader represents globals."""
    if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
        return
    key, numel = pid[2], pid[4]
    # torch always writes a string key and an int element count: anything else is damage.
    if (not isinstance(key, str) or not isinstance(numel, int) or isinstance(numel, bool)
            or numel < 0):
        raise ValueError(f"storage id {key!r} without a proper key and size")
    found[key] = (type_name(pid[1]), numel)

