"""What a condition says about which processes pass it.

A checkpoint write is safe when at most one process in the job reaches it for a given path.
Every piece of code is therefore given a *level*: how many processes can be running it.

    ONE   at most one process in the job (global rank 0, or not distributed at all)
    NODE  at most one process per node (local rank 0): still several on shared storage
    ALL   any number of processes

A condition is read as a pair (when_true, when_false): the level of the code that runs when it
holds and when it does not. `rank == 0` is (ONE, ALL), `rank != 0` is (ALL, ONE), `not` swaps the
pair, `and` keeps the tighter of the true sides (both hold) and the looser of the false sides
(either failed), `or` the reverse. Anything we do not recognise is (ALL, ALL): unknown conditions
never make a write look safe.

Pure functions on `ast` nodes; the names of rank-ish things are matched by their words
(`ddp_local_rank` is a local rank, `node_rank` is a node index and no guard at all).
"""
from __future__ import annotations

import ast
import re

ONE, NODE, ALL = 0, 1, 2
UNKNOWN = (ALL, ALL)

# Kinds of value an expression can be.
RANK = "rank"          # the global rank (unique in the job)
LOCAL = "local"        # the rank within a node (unique per node only)
NODE_INDEX = "node"    # the node's index (the same for every rank of a node)
WORLD = "world"        # the number of processes

# Boolean names that are true on exactly one process of the job...
RANK_ZERO_FLAGS = frozenset({
    "is_main_process", "is_global_zero", "is_world_process_zero", "should_save",
    "is_master", "master_process", "is_master_process", "is_main", "main_process",
    "is_rank_zero", "is_rank0", "rank_zero", "rank0", "is_chief", "is_master_ordinal",
    "is_main_rank", "is_zero_rank", "global_zero",
    # transformers' save_pretrained (5.x): `save_on_this_rank = self.should_save_on_this_rank(
    # is_main_process)`, which also requires torch.distributed rank 0 -- a global guard.
    "save_on_this_rank", "should_save_on_this_rank",
})
# ...on one process per node...
LOCAL_ZERO_FLAGS = frozenset({
    "is_local_main_process", "is_local_process_zero", "is_local_master", "local_master",
    "is_local_zero", "is_local_rank_zero", "is_node_master",
})
# ...and true whenever the job is distributed (false means a single process).
DISTRIBUTED_FLAGS = frozenset({
    "is_initialized", "distributed", "is_distributed", "ddp", "use_ddp", "multi_gpu",
    "use_distributed",
})

# `control.should_save` (transformers' TrainerControl) means "save at this step" and is true on
# every rank; only TrainingArguments.should_save is the per-process switch.
NOT_A_GUARD_RECEIVERS = ("control",)

_WORD = re.compile(r"[a-z0-9]+")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def words(identifier: str) -> list[str]:
    """`ddp_localRank` -> ['ddp', 'local', 'rank']."""
    return _WORD.findall(_CAMEL.sub("_", identifier).lower())


def identifier_kind(identifier: str) -> str | None:
    """The kind of value an identifier (or an environment variable's name) holds, by its words."""
    parts = words(identifier)
    if not parts:
        return None
    joined = "_".join(parts)
    if "localid" in parts or ("local" in parts and ("rank" in parts or "index" in parts)):
        return LOCAL
    if ("node" in parts or "group" in parts or "nodeid" in parts) and (
            "rank" in parts or "nodeid" in parts or "index" in parts):
        return NODE_INDEX
    if "rank" in parts or "procid" in parts or joined in ("process_index", "global_process_index"):
        return RANK
    if joined in ("world_size", "num_processes", "slurm_ntasks"):
        return WORLD
    return None


def last_name(node: ast.AST) -> str | None:
    """The final identifier of `a.b.c`, `c`, `a.b.c(...)`."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def receiver_name(node: ast.AST) -> str | None:
    """The identifier before the last dot: `control` in `control.should_save`."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return last_name(node.value)
    return None


def env_name(node: ast.AST) -> str | None:
    """`RANK` in os.environ["RANK"], os.environ.get("RANK", ...), os.getenv("RANK")."""
    if isinstance(node, ast.Subscript) and _is_environ(node.value):
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return key.value
    if isinstance(node, ast.Call) and node.args:
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            return None
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
            return first.value
        if last_name(func) == "getenv":
            return first.value
    return None


def _is_environ(node: ast.AST) -> bool:
    return last_name(node) == "environ"


def value_kind(node: ast.AST) -> str | None:
    """RANK, LOCAL, NODE_INDEX, WORLD or None for an expression: `args.local_rank`,
    `dist.get_rank()`, `int(os.environ["RANK"])`, `(rank := get_rank())`, `hvd.local_rank()`."""
    if isinstance(node, ast.NamedExpr):
        return value_kind(node.value)
    env = env_name(node)
    if env is not None:
        return identifier_kind(env)
    if isinstance(node, ast.Call):
        name = last_name(node.func)
        if name in ("int", "str", "float") and node.args:
            return value_kind(node.args[0])
        if name is None:
            return None
        return identifier_kind(name[4:] if name.startswith("get_") else name)
    if isinstance(node, (ast.Name, ast.Attribute)):
        return identifier_kind(last_name(node))
    return None


def _const(node: ast.AST):
    """An int for 0, -1, "0", "1"...; None otherwise."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _const(node.operand)
        return -inner if inner is not None else None
    if isinstance(node, ast.Constant) and not isinstance(node.value, bool):
        if isinstance(node.value, int):
            return node.value
        if isinstance(node.value, str) and re.fullmatch(r"-?\d+", node.value.strip()):
            return int(node.value)
    return None


def _consts(node: ast.AST):
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        values = [_const(e) for e in node.elts]
        if values and None not in values:
            return set(values)
    return None


_MIRROR = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}


def _compare(node: ast.Compare):
    if len(node.ops) != 1:
        return UNKNOWN
    op, left, right = node.ops[0], node.left, node.comparators[0]
    if value_kind(left) is None and value_kind(right) is not None:
        left, right = right, left
        op = _MIRROR.get(type(op), type(op))()
    kind = value_kind(left)
    if kind is None:
        return UNKNOWN
    if kind == WORLD:
        return _world_compare(op, _const(right))
    if kind not in (RANK, LOCAL):
        return UNKNOWN              # node_rank == 0: every rank of node 0, no guard
    one_process = ONE if kind == RANK else NODE
    if isinstance(op, (ast.In, ast.NotIn)):
        values = _consts(right)
        if not values or not values <= {-1, 0}:
            return UNKNOWN
        level = max(ONE if v == -1 else one_process for v in values)
        return (level, ALL) if isinstance(op, ast.In) else (ALL, level)
    c = _const(right)
    if c is None:
        return UNKNOWN
    # -1 is the "not distributed" convention (args.local_rank == -1): one process.
    level = ONE if c == -1 else one_process
    if isinstance(op, (ast.Eq, ast.Is)):
        return (level, ALL)
    if isinstance(op, (ast.NotEq, ast.IsNot)) and c in (0, -1):
        return (ALL, level)
    if (isinstance(op, ast.LtE) and c == 0) or (isinstance(op, ast.Lt) and c == 1):
        return (one_process, ALL)   # rank <= 0 also admits -1 (single process)
    if (isinstance(op, ast.Gt) and c == 0) or (isinstance(op, ast.GtE) and c == 1):
        return (ALL, one_process)
    return UNKNOWN


def _world_compare(op, c):
    if c is None:
        return UNKNOWN
    single = ((isinstance(op, ast.Eq) and c == 1) or (isinstance(op, ast.LtE) and c == 1)
              or (isinstance(op, ast.Lt) and c == 2))
    multi = ((isinstance(op, ast.Gt) and c == 1) or (isinstance(op, ast.NotEq) and c == 1)
             or (isinstance(op, ast.GtE) and c == 2))
    if single:
        return (ONE, ALL)
    if multi:
        return (ALL, ONE)
    return UNKNOWN


def flag_levels(node: ast.AST, save_on_each_node: bool = False):
    """(when_true, when_false) for a boolean name, attribute or call by its last identifier."""
    name = last_name(node)
    if name is None:
        return UNKNOWN
    if name in RANK_ZERO_FLAGS:
        if name == "should_save":
            receiver = receiver_name(node) or ""
            if any(r in receiver.lower() for r in NOT_A_GUARD_RECEIVERS):
                return UNKNOWN
            # TrainingArguments(save_on_each_node=True) makes should_save true per node.
            return (NODE if save_on_each_node else ONE, ALL)
        return (ONE, ALL)
    if name in LOCAL_ZERO_FLAGS:
        return (NODE, ALL)
    if name in DISTRIBUTED_FLAGS:
        return (ALL, ONE)
    return UNKNOWN


def levels(node: ast.AST, resolve=None, save_on_each_node: bool = False, depth: int = 0):
    """(when_true, when_false) for a condition.

    resolve(name) returns the expressions assigned to a plain name (`is_master = rank == 0`),
    so a flag computed once and tested later is understood; depth bounds that chase.
    """
    if depth > 8:
        return UNKNOWN
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        t, f = levels(node.operand, resolve, save_on_each_node, depth + 1)
        return (f, t)
    if isinstance(node, ast.BoolOp):
        pairs = [levels(v, resolve, save_on_each_node, depth + 1) for v in node.values]
        ts, fs = [p[0] for p in pairs], [p[1] for p in pairs]
        if isinstance(node.op, ast.And):
            return (min(ts), max(fs))
        return (max(ts), min(fs))
    if isinstance(node, ast.NamedExpr):
        return levels(node.value, resolve, save_on_each_node, depth + 1)
    if isinstance(node, ast.Compare):
        return _compare(node)
    if isinstance(node, (ast.Name, ast.Attribute, ast.Call)):
        if isinstance(node, ast.Call) and last_name(node.func) == "bool" and node.args:
            return levels(node.args[0], resolve, save_on_each_node, depth + 1)
        pair = flag_levels(node, save_on_each_node)
        if pair != UNKNOWN or resolve is None:
            return pair
        if isinstance(node, ast.Name) or _is_self_attr(node):
            return _alias_levels(node, resolve, save_on_each_node, depth)
    return UNKNOWN


def _is_self_attr(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _alias_levels(node, resolve, save_on_each_node, depth):
    """A flag assigned elsewhere: the loosest of its non-trivial assignments (so a name that is
    `rank == 0` on one path and `True` in the single-process branch still counts as a guard,
    but one assigned two different guards takes the weaker)."""
    pairs = [levels(value, resolve, save_on_each_node, depth + 1) for value in resolve(node)]
    pairs = [p for p in pairs if p != UNKNOWN]
    if not pairs:
        return UNKNOWN
    return (max(p[0] for p in pairs), max(p[1] for p in pairs))
