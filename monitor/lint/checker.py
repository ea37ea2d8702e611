"""Find checkpoint writes that more than one process can reach, in one Python module.

The module is cut into units (the module body and every function). Each unit is walked once
with the level of the code it is in (monitor/lint/guards.py: ONE, NODE or ALL processes),
starting from ALL, recording its checkpoint writes and the calls it makes. A function's own
level is then the loosest level of its call sites in the module (a helper only ever called
under `if rank == 0` runs on rank 0 only), `@rank_zero_only` / `@accelerator.on_main_process`
make it ONE, and a function with no call site here, or one passed around as a value, is ALL:
someone else calls it, on every rank. That is worked out to a fixed point, starting from ALL so
that recursion never makes a function look guarded.

A write's level is the tightest of: the code around it, the path (a path holding the global
rank is per-rank, one holding only the local rank is per-node), and an `is_main_process=`
argument. ALL is CKW001, NODE is CKW002. Collective saves (DeepSpeed's save_checkpoint, DCP,
accelerator.save_state) are the reverse mistake: under a rank guard they are CKW003.

Pure: source text in, findings out. No imports of the code under analysis.
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field

from ckptwatch.advice import FIX
from monitor.lint import guards
from monitor.lint.guards import ALL, NODE, ONE

UNGUARDED = "CKW001"
LOCAL_ONLY = "CKW002"
COLLECTIVE_GUARDED = "CKW003"
UNREADABLE = "CKW999"

CODES = {
    UNGUARDED: "checkpoint write can run on every rank",
    LOCAL_ONLY: "checkpoint write is unique per node only (local rank)",
    COLLECTIVE_GUARDED: "collective checkpoint save under a rank guard",
    UNREADABLE: "file could not be parsed",
}

_DISTRIBUTED_MODULES = (
    "torch.distributed", "torch.nn.parallel", "torch.multiprocessing", "accelerate",
    "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed", "horovod", "torch_xla",
    "fairscale", "colossalai", "ray.train",
)
_TRANSFORMERS_TRAINING = re.compile(r"Trainer|TrainingArguments|TrainerCallback|TrainerState|"
                                    r"TrainerControl")
_SUPPRESS = re.compile(r"#\s*ckptwatch:\s*ignore(?:\[([A-Za-z0-9,\s]*)\])?")
_DUMPS = {"pickle.dump", "_pickle.dump", "json.dump", "cloudpickle.dump", "dill.dump"}
_NUMPY = {"numpy.save", "numpy.savez", "numpy.savez_compressed"}
_OPENERS = {"open", "io.open", "builtins.open", "gzip.open", "bz2.open", "lzma.open"}
_DCP = re.compile(r"torch\.distributed\.checkpoint(\.\w+)*\.(save|save_state_dict|async_save)$")
_UNIQUE_NAMES = {"mkdtemp", "mkstemp", "NamedTemporaryFile", "TemporaryDirectory", "uuid4",
                 "uuid1", "token_hex"}
_GUARD_DECORATORS = {"rank_zero_only": ONE, "on_main_process": ONE,
                     "on_local_main_process": NODE}


@dataclass(frozen=True, order=True)
class LintFinding:
    """One report of `ckptwatch lint`: where in the source, which rule, what to change."""

    path: str
    line: int
    col: int            # 1-based, as ruff and flake8 print it
    code: str
    message: str

    def to_json(self) -> dict:
        return {"path": self.path, "line": self.line, "col": self.col, "code": self.code,
                "message": self.message}

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message}"


@dataclass
class _Write:
    call: ast.Call
    what: str                   # "torch.save", "save_pretrained", ...
    level: int                  # the code around it, before the unit's own level
    path_level: int = ALL       # ONE: per-rank path, NODE: per-node path
    self_guarded: int = ALL     # is_main_process=..., accelerate's own guard
    collective: bool = False
    each_node: bool = False     # accelerate with save_on_each_node=True


@dataclass
class _Unit:
    node: ast.AST
    name: str
    is_method: bool = False
    parent: "_Unit | None" = None
    assigns: dict = field(default_factory=dict)      # name -> [value expr]
    opens: dict = field(default_factory=dict)        # name -> (open call, level)
    writes: list = field(default_factory=list)
    calls: list = field(default_factory=list)        # (name, by_attribute, level)
    decorated: int = ALL


def lint_source(source: str, path: str = "<string>",
                assume_distributed: bool = False) -> list[LintFinding]:
    """Findings for one module's source, suppressions applied, sorted by position."""
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError) as err:
        line = getattr(err, "lineno", None) or 1
        col = getattr(err, "offset", None) or 1
        msg = getattr(err, "msg", None) or str(err)
        return [LintFinding(path, line, col, UNREADABLE, f"syntax error: {msg}")]
    except RecursionError:
        return [LintFinding(path, 1, 1, UNREADABLE, "too deeply nested to parse")]
    except MemoryError:
        return [LintFinding(path, 1, 1, UNREADABLE, "not checked: too large to parse in "
                                                     "the memory available")]
    try:
        module = _Module(tree)
        if not (assume_distributed or module.distributed):
            return []
        findings = [LintFinding(path, call.lineno, call.col_offset + 1, code, message)
                    for call, code, message in module.findings()]
    except RecursionError:
        # The walk recurses per nesting level; code nested past the interpreter's limit is
        # reported as unchecked rather than crashing the whole run.
        return [LintFinding(path, 1, 1, UNREADABLE, "too deeply nested to analyse")]
    suppressed = _suppressions(source)
    return sorted(f for f in findings if not _is_suppressed(f, suppressed, module.spans))


# ---------------------------------------------------------------------------- the module


class _Module:
    def __init__(self, tree: ast.Module):
        self.tree = tree
        self.aliases = _import_aliases(tree)
        self.units: list[_Unit] = []
        self.self_assigns: dict = {}                 # self.X -> [value expr], module-wide
        self.engines: set = set()                    # names bound by deepspeed.initialize()
        self.escaped_names: set = set()              # functions used as values
        self.escaped_attrs: set = set()              # methods used as values (self.f)
        self.spans: dict = {}                        # call line -> last line of the call
        self.save_on_each_node = _save_on_each_node(tree)
        self.distributed = self._is_distributed()
        self.module_unit = _Unit(tree, "<module>")
        self._collect(self.module_unit)
        for unit in self.units:
            _Walker(self, unit).walk()

    # -- reading the module

    def qualified(self, node: ast.AST) -> str | None:
        """`np.save` -> 'numpy.save' through the module's imports."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def is_module_name(self, node: ast.AST) -> bool:
        return isinstance(node, ast.Name) and node.id in self.aliases and "." not in node.id

    def _is_distributed(self) -> bool:
        """Does anything in the module say it runs as several processes?"""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                if any(_startswith_module(a.name, _DISTRIBUTED_MODULES) for a in node.names):
                    return True
            elif isinstance(node, ast.ImportFrom) and node.module:
                if _startswith_module(node.module, _DISTRIBUTED_MODULES):
                    return True
                if (node.module.split(".")[0] == "transformers"
                        and any(_TRANSFORMERS_TRAINING.search(a.name) for a in node.names)):
                    return True
            elif isinstance(node, ast.Attribute):
                qual = self.qualified(node) or ""
                if _startswith_module(qual, _DISTRIBUTED_MODULES) or (
                        qual.startswith("transformers.")
                        and _TRANSFORMERS_TRAINING.search(node.attr)):
                    return True
            if isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
                if guards.value_kind(node) in (guards.RANK, guards.LOCAL, guards.WORLD):
                    return True
                if guards.flag_levels(node) != guards.UNKNOWN and not isinstance(node, ast.Name):
                    return True
        return False

    def _collect(self, unit: _Unit) -> None:
        """Register the unit, its assignments (own scope) and, recursively, inner functions."""
        self.units.append(unit)
        methods = set()
        for node in _own_scope(unit.node.body):
            if isinstance(node, ast.ClassDef):
                methods.update(id(n) for n in node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = _Unit(node, node.name, is_method=id(node) in methods, parent=unit)
                for deco in node.decorator_list:
                    inner.decorated = min(inner.decorated,
                                          _GUARD_DECORATORS.get(guards.last_name(deco), ALL))
                self._collect(inner)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                self._note_assignment(unit, node)
            elif isinstance(node, ast.withitem) and isinstance(node.optional_vars, ast.Name):
                unit.assigns.setdefault(node.optional_vars.id, []).append(node.context_expr)
            elif isinstance(node, ast.NamedExpr):
                unit.assigns.setdefault(node.target.id, []).append(node.value)
            elif isinstance(node, ast.Call):
                self.spans[node.lineno] = max(self.spans.get(node.lineno, node.lineno),
                                              node.end_lineno or node.lineno)

    def _note_assignment(self, unit: _Unit, node) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
        if value is None or isinstance(node, ast.AugAssign):
            return
        for target in targets:
            if isinstance(target, ast.Name):
                unit.assigns.setdefault(target.id, []).append(value)
            elif guards._is_self_attr(target):
                self.self_assigns.setdefault(target.attr, []).append(value)
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Call):
                if (self.qualified(value.func) or "").startswith("deepspeed.initialize"):
                    first = target.elts[0] if target.elts else None
                    if isinstance(first, ast.Name):
                        self.engines.add(first.id)

    def resolve(self, unit: _Unit):
        """The values assigned to a name as seen from unit: its own, else an enclosing one's."""
        def lookup(node):
            if isinstance(node, ast.Attribute):
                return self.self_assigns.get(node.attr, [])
            scope = unit
            while scope is not None:
                if node.id in scope.assigns:
                    return scope.assigns[node.id]
                scope = scope.parent
            return []
        return lookup

    # -- levels and findings

    def unit_levels(self) -> dict:
        """id(unit) -> level of the unit's own code, to a fixed point (see the module doc)."""
        level = {id(u): ALL for u in self.units}
        for unit in self.units:
            level[id(unit)] = unit.decorated
        functions = [u for u in self.units if u is not self.module_unit
                     and u.decorated == ALL]
        by_name = {}
        for u in functions:
            by_name.setdefault((u.name, u.is_method), []).append(u)
        sites = {id(u): [] for u in functions}
        for caller in self.units:
            for (name, by_attr, at) in caller.calls:
                for u in by_name.get((name, by_attr), ()):
                    sites[id(u)].append((caller, at))
        for _ in range(len(functions) + 1):
            changed = False
            for u in functions:
                escaped = u.name in (self.escaped_attrs if u.is_method else self.escaped_names)
                if escaped or not sites[id(u)]:
                    new = ALL
                else:
                    new = max(min(at, level[id(caller)]) for caller, at in sites[id(u)])
                if new != level[id(u)]:
                    level[id(u)], changed = new, True
            if not changed:
                break
        return level

    def findings(self):
        level = self.unit_levels()
        for unit in self.units:
            for w in unit.writes:
                guarded = min(w.level, level[id(unit)], w.self_guarded)
                if w.collective:
                    if guarded < ALL:
                        yield (w.call, COLLECTIVE_GUARDED,
                               f"{w.what} is collective: under a rank guard the other ranks "
                               "never join it (a hang or missing shards); call it on every rank")
                    continue
                effective = min(guarded, w.path_level)
                if effective == ALL:
                    yield (w.call, UNGUARDED, f"{w.what} runs on every rank; {FIX}")
                elif effective == NODE and guarded == NODE and w.each_node:
                    yield (w.call, LOCAL_ONLY,
                           f"{w.what} saves on each node (save_on_each_node=True): nodes "
                           "collide on shared storage")
                elif effective == NODE and guarded == NODE:
                    yield (w.call, LOCAL_ONLY,
                           f"{w.what} is guarded only by the local rank: one writer per node, "
                           "nodes collide on shared storage; guard with the global rank")
                elif effective == NODE:
                    yield (w.call, LOCAL_ONLY,
                           f"{w.what} path holds only the local rank: unique per node, nodes "
                           "collide on shared storage; use the global rank")


# ---------------------------------------------------------------------------- the walk


class _Walker:
    """Walks one unit's statements with the level of the code they are in."""

    def __init__(self, module: _Module, unit: _Unit):
        self.m, self.unit = module, unit
        self.resolve = module.resolve(unit)

    def walk(self) -> None:
        node = self.unit.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.block(node.body, ALL)
        elif isinstance(node, ast.Module):
            self.block(node.body, ALL)

    def cond(self, test: ast.AST):
        return guards.levels(test, self.resolve, self.m.save_on_each_node)

    def block(self, stmts, level: int) -> None:
        for stmt in stmts:
            self.stmt(stmt, level)
            # After `if rank != 0: return`, the rest of the block runs on rank 0 only.
            if isinstance(stmt, ast.If):
                t, f = self.cond(stmt.test)
                if _terminates(stmt.body):
                    level = min(level, f)
                elif stmt.orelse and _terminates(stmt.orelse):
                    level = min(level, t)
            elif isinstance(stmt, ast.Assert):
                level = min(level, self.cond(stmt.test)[0])

    def stmt(self, stmt: ast.stmt, level: int) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for expr in stmt.decorator_list + stmt.args.defaults + stmt.args.kw_defaults:
                if expr is not None:
                    self.expr(expr, level)
            return                                   # its body is a unit of its own
        if isinstance(stmt, ast.If):
            t, f = self.cond(stmt.test)
            self.expr(stmt.test, level)
            self.block(stmt.body, min(level, t))
            self.block(stmt.orelse, min(level, f))
            return
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                self.expr(item.context_expr, level)
                if isinstance(item.optional_vars, ast.Name):
                    self.unit.opens[item.optional_vars.id] = (item.context_expr, level)
            self.block(stmt.body, level)
            return
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    self.unit.opens[target.id] = (stmt.value, level)
        for name, value in ast.iter_fields(stmt):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.block(value, level)
            elif isinstance(value, list):
                for item in value:
                    self.child(item, level)
            elif isinstance(value, ast.AST):
                self.child(value, level)

    def child(self, node, level: int) -> None:
        if isinstance(node, ast.expr):
            self.expr(node, level)
        elif isinstance(node, (ast.excepthandler, ast.match_case)):
            for name, value in ast.iter_fields(node):
                if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                    self.block(value, level)
                elif isinstance(value, ast.AST):
                    self.child(value, level)
        elif isinstance(node, ast.AST):
            for sub in ast.iter_child_nodes(node):
                self.child(sub, level)

    def expr(self, node: ast.AST, level: int) -> None:
        if isinstance(node, ast.IfExp):
            t, f = self.cond(node.test)
            self.expr(node.test, level)
            self.expr(node.body, min(level, t))
            self.expr(node.orelse, min(level, f))
            return
        if isinstance(node, ast.BoolOp):
            # `rank == 0 and torch.save(...)`: later operands run only past the earlier ones.
            for value in node.values:
                self.expr(value, level)
                t, f = self.cond(value)
                level = min(level, t if isinstance(node.op, ast.And) else f)
            return
        if isinstance(node, ast.Lambda):
            self.expr(node.body, ALL)                # called whenever, by whoever
            return
        if isinstance(node, ast.Call):
            self.call(node, level)
            func = node.func
            if isinstance(func, ast.Attribute):
                self.expr(func.value, level)
            elif not isinstance(func, ast.Name):
                self.expr(func, level)
            for sub in node.args + [k.value for k in node.keywords]:
                self.expr(sub, level)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            self.m.escaped_names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self.m.escaped_attrs.add(node.attr)
        for sub in ast.iter_child_nodes(node):
            if isinstance(sub, ast.expr):
                self.expr(sub, level)
            else:
                self.child(sub, level)

    # -- calls

    def call(self, call: ast.Call, level: int) -> None:
        func = call.func
        if isinstance(func, ast.Name):
            self.unit.calls.append((func.id, False, level))
        elif isinstance(func, ast.Attribute) and not self.m.is_module_name(func.value):
            self.unit.calls.append((func.attr, True, level))
        write = self.classify(call, level)
        if write is not None:
            self.unit.writes.append(write)

    def classify(self, call: ast.Call, level: int) -> _Write | None:
        qual = self.m.qualified(call.func) or ""
        attr = call.func.attr if isinstance(call.func, ast.Attribute) else None
        receiver = (guards.last_name(call.func.value) or "") if attr else ""
        recv = receiver.lower()
        if _DCP.match(qual):
            what = qual.split(".")[-1] + " (torch.distributed.checkpoint)"
            if _no_dist(call):
                # no_dist=True: no collective, this process writes the whole set (shards and
                # .metadata) itself; on several ranks they all write the same files.
                return _Write(call, what + " with no_dist=True", level,
                              self.path_level(_arg(call, 99, "checkpoint_id")))
            return _Write(call, what, level, collective=True)
        if (attr == "save_checkpoint" and "checkpoint_io" in recv
                and self.unit.name != "save_checkpoint"):
            # (A save_checkpoint that hands on to another checkpoint_io is a plugin wrapper:
            # whoever calls it guards it.)
            # Lightning's CheckpointIO writes the file it is given on whichever process calls
            # it (the Trainer calls it on global rank 0 only; a user calling it directly must
            # guard it the same way).
            return self.file_write(call, f"{receiver}.save_checkpoint", level,
                                   _arg(call, 1, "path"))
        if attr == "save_checkpoint" and ("engine" in recv or recv == "trainer"
                                          or receiver in self.m.engines):
            return _Write(call, f"{receiver}.save_checkpoint", level, collective=True)
        if attr == "save_state" and "accelerator" in recv:
            return _Write(call, f"{receiver}.save_state", level, collective=True)
        if attr == "save" and "fabric" in recv:
            return _Write(call, f"{receiver}.save", level, collective=True)
        if attr in ("save", "save_model") and "accelerator" in recv:
            # accelerate writes on the main process only, or on each node's main process
            # with save_on_each_node=True.
            own = NODE if self.m.save_on_each_node else ONE
            write = self.file_write(call, f"{receiver}.{attr}", level, _arg(call, 1, "f"),
                                    self_guarded=own)
            if write is not None:
                write.each_node = self.m.save_on_each_node
            return write
        if qual == "torch.save":
            return self.file_write(call, "torch.save", level, _arg(call, 1, "f"))
        if qual in _NUMPY:
            return self.file_write(call, "np." + qual.split(".")[-1], level,
                                   _arg(call, 0, "file"))
        if qual.startswith("safetensors.") and qual.rsplit(".", 1)[-1] in ("save_file",
                                                                          "save_model"):
            return self.file_write(call, qual.rsplit(".", 1)[-1] + " (safetensors)", level,
                                   _arg(call, 1, "filename"))
        if qual in _DUMPS:
            return self.file_write(call, qual, level, _arg(call, 1, "fp", "file"),
                                   needs_open=True)
        if attr == "save_pretrained":
            own = ALL
            for kw in call.keywords:
                if kw.arg == "is_main_process":
                    own = self.cond(kw.value)[0]
            return self.file_write(call, f"{receiver or '...'}.save_pretrained", level,
                                   _arg(call, 0, "save_directory"), self_guarded=own)
        return None

    def file_write(self, call, what, level, target, self_guarded=ALL, needs_open=False):
        """A write to `target`: a path, or a file object opened for writing in this unit."""
        if target is None:
            return None if needs_open else _Write(call, what, level, self_guarded=self_guarded)
        opened = self.opened(target, level)
        if opened is not None:
            open_call, open_level = opened
            path, mode = _open_args(open_call, self.m)
            if not _writes(mode):
                return None
            # An open for writing truncates on every process that reaches it, so the write is
            # only as guarded as the looser of the two.
            return _Write(call, what, max(level, open_level), self.path_level(path),
                          self_guarded)
        if needs_open or self.in_memory(target):
            return None
        return _Write(call, what, level, self.path_level(target), self_guarded)

    def opened(self, target, level):
        """(open call, its level) when target is a file opened here, inline or by name."""
        if isinstance(target, ast.Call) and _is_open(target, self.m):
            return target, level
        if isinstance(target, ast.Name):
            found = self.unit.opens.get(target.id)
            if found and _is_open(found[0], self.m):
                return found
        return None

    def in_memory(self, target) -> bool:
        values = [target]
        if isinstance(target, ast.Name):
            values = self.resolve(target) or [target]
        return all(isinstance(v, ast.Call) and guards.last_name(v.func) in ("BytesIO", "StringIO")
                   for v in values) and bool(values)

    def path_level(self, path) -> int:
        if self._unique_per_process(path):
            return ONE
        kinds = set()
        self._path_kinds(path, kinds, 0, set())
        if guards.RANK in kinds or {guards.LOCAL, guards.NODE_INDEX} <= kinds:
            return ONE
        if guards.LOCAL in kinds:
            return NODE
        return ALL

    def _unique_per_process(self, path) -> bool:
        """A path made by tempfile.mkdtemp()/mkstemp() or uuid: each process its own."""
        values = [path] if path is not None else []
        if isinstance(path, ast.Name):
            values = self.resolve(path) or values
        for value in values:
            for node in ast.walk(value):
                if isinstance(node, ast.Call) and guards.last_name(node.func) in _UNIQUE_NAMES:
                    return True
        return False

    def _path_kinds(self, expr, kinds, depth, seen) -> None:
        if expr is None or depth > 4:
            return
        for node in ast.walk(expr):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for template in re.findall(r"\{([A-Za-z_]\w*)[^}]*\}", node.value):
                    kind = guards.identifier_kind(template)   # "ckpt_{rank}.pt".format(...)
                    if kind:
                        kinds.add(kind)
            elif isinstance(node, ast.JoinedStr):
                _rank_prefixed(node, kinds)
            elif isinstance(node, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
                kind = guards.value_kind(node)
                if kind:
                    kinds.add(kind)
                elif isinstance(node, ast.Name) and node.id not in seen:
                    seen.add(node.id)
                    for value in self.resolve(node):
                        self._path_kinds(value, kinds, depth + 1, seen)


# ---------------------------------------------------------------------------- helpers


def _arg(call: ast.Call, index: int, *keywords):
    for kw in call.keywords:
        if kw.arg in keywords:
            return kw.value
    if len(call.args) > index and not isinstance(call.args[index], ast.Starred):
        return call.args[index]
    return None


def _is_open(call: ast.AST, module: _Module) -> bool:
    if not isinstance(call, ast.Call):
        return False
    qual = module.qualified(call.func) or ""
    return qual in _OPENERS or (isinstance(call.func, ast.Attribute) and call.func.attr == "open")


def _no_dist(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "no_dist":
            # Only a literal True: DCP's own wrappers pass their caller's no_dist through.
            return isinstance(kw.value, ast.Constant) and kw.value.value is True
    return False


def _open_args(call: ast.Call, module: _Module):
    """(path expr, mode string or None) of open(path, mode) or Path(...).open(mode)."""
    qual = module.qualified(call.func) or ""
    mode_node = None
    if qual in _OPENERS:
        path, mode_node = _arg(call, 0, "file", "filename"), _arg(call, 1, "mode")
    else:
        path, mode_node = call.func.value, _arg(call, 0, "mode")
    if mode_node is None:
        return path, "r"
    if isinstance(mode_node, ast.Constant) and isinstance(mode_node.value, str):
        return path, mode_node.value
    return path, None           # a computed mode: assume it may write


def _writes(mode) -> bool:
    return mode is None or any(c in mode for c in "wax+")


def _rank_prefixed(node: ast.JoinedStr, kinds: set) -> None:
    """f"rank_{i}", f"rank-{i}": the author names the part after it a rank."""
    for before, after in zip(node.values, node.values[1:]):
        if (isinstance(before, ast.Constant) and isinstance(before.value, str)
                and isinstance(after, ast.FormattedValue)):
            tail = guards.words(before.value[-12:])
            if tail and tail[-1] in ("rank", "localrank"):
                kinds.add(guards.LOCAL if "local" in tail[-2:] else guards.RANK)


def _terminates(stmts) -> bool:
    """Does this block always leave the enclosing block (return, raise, continue, exit)?"""
    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        return guards.last_name(last.value.func) in ("exit", "_exit", "quit")
    if isinstance(last, ast.If):
        return _terminates(last.body) and _terminates(last.orelse)
    return False


def _own_scope(body):
    """Nodes of a scope, not descending into inner functions or lambdas (their own units).
    Class bodies are walked: their methods become units of the enclosing scope's class."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _startswith_module(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _import_aliases(tree) -> dict:
    """Local name -> dotted origin for every import in the module (any scope)."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def _save_on_each_node(tree) -> bool:
    """accelerate's ProjectConfiguration / TrainingArguments(save_on_each_node=True) anywhere."""
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "save_on_each_node":
            if not (isinstance(node.value, ast.Constant) and not node.value.value):
                return True
    return False


def _suppressions(source: str) -> dict:
    """line -> set of suppressed codes (empty set: all codes), from real comments only."""
    out = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            match = _SUPPRESS.search(tok.string)
            if match:
                codes = match.group(1)
                out[tok.start[0]] = ({c.strip().upper() for c in codes.split(",") if c.strip()}
                                     if codes is not None else set())
    except (tokenize.TokenError, SyntaxError):
        pass
    return out


def _is_suppressed(finding: LintFinding, suppressed: dict, spans: dict) -> bool:
    """A comment on any line of the call suppresses it (a long call wraps)."""
    last = spans.get(finding.line, finding.line)
    for line in range(finding.line, last + 1):
        codes = suppressed.get(line)
        if codes is not None and (not codes or finding.code in codes):
            return True
    return False
