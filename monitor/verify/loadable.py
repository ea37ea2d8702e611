"""Could torch.load(weights_only=True) load this pickle? The names a checkpoint's pickle may
reference for that, without importing torch.

"ok" from the verifier means a checkpoint is structurally whole, nothing more: a pickle can
name any callable (os.system, subprocess.Popen, builtins.eval), and torch.load with
weights_only=False calls it. torch.load(weights_only=True) (the default since torch 2.6)
refuses every global outside an allowlist: torch's own tensor rebuild functions, its storage,
tensor and dtype names, and a few builtins. WEIGHTS_ONLY_GLOBALS is that allowlist, copied from
torch 2.13.0 (torch._weights_only_unpickler._get_allowed_globals();
tests/unit/test_loadable.py compares it with the installed torch). Names a user allowed with
torch.serialization.add_safe_globals are not known here: such a checkpoint is reported as
needing them, which it does.

Pure: the standard library only (monitor.verify never imports torch).
"""
from __future__ import annotations

import _compat_pickle

WEIGHTS_ONLY_GLOBALS = frozenset("""
    _codecs.encode builtins.bytearray builtins.complex builtins.set collections.Counter
    collections.OrderedDict torch.BFloat16Storage torch.BFloat16Tensor torch.BoolStorage
    torch.BoolTensor torch.ByteStorage torch.ByteTensor torch.CharStorage torch.CharTensor
    torch.ComplexDoubleStorage torch.ComplexFloatStorage torch.DoubleStorage
    torch.DoubleTensor torch.FloatStorage torch.FloatTensor torch.HalfStorage
    torch.HalfTensor torch.IntStorage torch.IntTensor torch.LongStorage torch.LongTensor
    torch.QInt32Storage torch.QInt8Storage torch.QUInt2x4Storage torch.QUInt4x2Storage
    torch.QUInt8Storage torch.ShortStorage torch.ShortTensor torch.Size torch.Tensor
    torch._tensor._rebuild_from_type_v2 torch._utils._rebuild_device_tensor_from_cpu_tensor
    torch._utils._rebuild_device_tensor_from_numpy
    torch._utils._rebuild_meta_tensor_no_storage torch._utils._rebuild_nested_tensor
    torch._utils._rebuild_parameter torch._utils._rebuild_parameter_with_state
    torch._utils._rebuild_qtensor torch._utils._rebuild_sparse_tensor
    torch._utils._rebuild_tensor torch._utils._rebuild_tensor_v2
    torch._utils._rebuild_tensor_v3 torch._utils._rebuild_wrapper_subclass torch.bfloat16
    torch.bits16 torch.bits1x8 torch.bits2x4 torch.bits4x2 torch.bits8 torch.bool
    torch.complex128 torch.complex32 torch.complex64 torch.cuda.BFloat16Storage
    torch.cuda.BFloat16Tensor torch.cuda.BoolStorage torch.cuda.BoolTensor
    torch.cuda.ByteStorage torch.cuda.ByteTensor torch.cuda.CharStorage
    torch.cuda.CharTensor torch.cuda.ComplexDoubleStorage torch.cuda.ComplexFloatStorage
    torch.cuda.DoubleStorage torch.cuda.DoubleTensor torch.cuda.FloatStorage
    torch.cuda.FloatTensor torch.cuda.HalfStorage torch.cuda.HalfTensor
    torch.cuda.IntStorage torch.cuda.IntTensor torch.cuda.LongStorage torch.cuda.LongTensor
    torch.cuda.ShortStorage torch.cuda.ShortTensor torch.cuda.sparse.BFloat16Tensor
    torch.cuda.sparse.ByteTensor torch.cuda.sparse.CharTensor torch.cuda.sparse.DoubleTensor
    torch.cuda.sparse.FloatTensor torch.cuda.sparse.HalfTensor torch.cuda.sparse.IntTensor
    torch.cuda.sparse.LongTensor torch.cuda.sparse.ShortTensor torch.device torch.float16
    torch.float32 torch.float4_e2m1fn_x2 torch.float64 torch.float8_e4m3fn
    torch.float8_e4m3fnuz torch.float8_e5m2 torch.float8_e5m2fnuz torch.float8_e8m0fnu
    torch.int1 torch.int16 torch.int2 torch.int3 torch.int32 torch.int4 torch.int5
    torch.int6 torch.int64 torch.int7 torch.int8 torch.nn.parameter.Parameter
    torch.per_channel_affine torch.per_channel_affine_float_qparams
    torch.per_channel_symmetric torch.per_tensor_affine torch.per_tensor_symmetric
    torch.qint32 torch.qint8 torch.quint2x4 torch.quint4x2 torch.quint8
    torch.serialization._get_layout torch.sparse.BFloat16Tensor torch.sparse.ByteTensor
    torch.sparse.CharTensor torch.sparse.DoubleTensor torch.sparse.FloatTensor
    torch.sparse.HalfTensor torch.sparse.IntTensor torch.sparse.LongTensor
    torch.sparse.ShortTensor torch.storage.TypedStorage torch.storage.UntypedStorage
    torch.uint1 torch.uint16 torch.uint2 torch.uint3 torch.uint32 torch.uint4 torch.uint5
    torch.uint6 torch.uint64 torch.uint7 torch.uint8
""".split())

MAX_LISTED = 8          # names a verdict lists (each cut to MAX_NAME characters)
MAX_NAME = 200


def canonical(module: str, name: str) -> str:
    """"module.name" as Python 3 unpickles it (a protocol-2 pickle written by Python 2 names
    __builtin__, copy_reg, ...: the same mapping pickle and torch apply)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def refused(names) -> list[str]:
    """The names of `names` ("module.name") torch.load(weights_only=True) refuses, sorted."""
    return sorted(n for n in names if n not in WEIGHTS_ONLY_GLOBALS)
